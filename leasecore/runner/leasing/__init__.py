"""The lease engine: its scheduling as a pure core stepped by events (``core``, with its wake-up
times and request queue in ``schedule`` and its book of leases in ``leasebook``), the threaded driver
(``engine``), the requests and what their answers mean (``leasecalls``), who sends them (``senders``),
its timer thread (``timer``) and the guard that keeps a task's heartbeats off its final update
(``finalupdates``).
"""
