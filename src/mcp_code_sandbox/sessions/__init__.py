"""Session lifecycle: the manager, on-disk records, recovery, ids, uids, quotas, worker
threads, and the executors the manager hands out (:mod:`.executor`: the agent's and
runner images' clients).

A layer above :mod:`..backends` and :mod:`..workspace`; it never imports the run path or
the server.
"""
