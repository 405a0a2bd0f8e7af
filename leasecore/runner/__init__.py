"""The running worker: the wiring that builds it from a resolved config (``wiring``, with the
cgroup wiring ``treegroups``); the main loop, the one thread that owns per-task state (``loop/``);
the lease engine (``leasing/``); the loops that talk to the server: polls, final updates, task logs
and how each call went (``upstream/``). Under them all, pure: the ports every part depends on
(``ports``) and the update-v2 chaining decisions (``chain``). The decisions themselves live in the
pure core (``leasecore.lease``, ``leasecore.handover``).
"""
