"""The lease engine: every lease of this process, steppable (``engine``), its book of leases
(``leasebook``), the requests and what their answers mean (``leasecalls``), who sends them
(``senders``), its timer (``timer``) and the guard that keeps a task's heartbeats off its final
update (``finalupdates``).
"""
