"""Session lifecycle: the manager, on-disk records, recovery, ids, uids, quotas, worker threads.

A layer above :mod:`..backends` and :mod:`..workspace`; it never imports the run path or the server.
"""
