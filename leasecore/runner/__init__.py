"""The running worker: the wiring that builds it from a resolved config (``wiring``), the main loop
that owns per-task state (``runner``), the lease engine (``engine``, with its ``senders``, ``timer``,
``leasebook`` and ``leasecalls``, and ``finalupdates``, the guard around each final update), the
pollers (``poller``, with the pure ``pollpolicy``), the final updates (``reporter``), task logs
(``logsink``), server contact (``contact``), status snapshots (``status``), the ports every part
depends on (``ports``), the events of the main loop's queue (``events``), signal capture
(``signals``) and the cgroup wiring (``treegroups``). The decisions themselves live in the pure core
(``leasecore.lease``, ``leasecore.handover``).
"""
