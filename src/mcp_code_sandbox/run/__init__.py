"""The run path: a checked request (:mod:`.request`), one call from start to report
(:mod:`.execute`), output capture, and which languages are offered (:mod:`.languages`).

A layer above :mod:`..sessions`, which hands out what executes a run
(:mod:`..sessions.executor`), and below :mod:`..service`. It only calls down.
"""
