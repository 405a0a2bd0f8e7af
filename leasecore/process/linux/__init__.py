"""The Linux layer: what the kernel holds and how to ask it: process facts from /proc and signals
that cannot hit a recycled pid (``procfs``), the cgroup file operations (``cgroupfs``) and the
choice of mechanism (``cgroups``), who a child runs as (``runas``), what the runner does to
itself against same-user children (``hardening``), and the state directory's record of live
trees with the sweep of a dead runner's (``leftovers``).

``procfs``, ``cgroupfs`` and ``leftovers`` are stdlib only (the fork server imports them); this
file stays a docstring for the same reason.
"""
