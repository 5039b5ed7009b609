"""The run path: a checked request, one call from start to report, and the executors it runs on.

A layer above :mod:`..sessions` (which hands out executors) and below :mod:`..service`.
"""
