"""``conductor-run fleet``: the pure view of queues and pollers (``view``) and the two server reads
it is built from (``source``).
"""
