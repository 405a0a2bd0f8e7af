"""The runner's side of process supervision: the ``Supervisor`` (``supervisor``), one command's
record (``child``), the children held and their tree records (``running``), the spawns not answered
yet (``inflight``), the thread reading every child's output and the fork server's events
(``reader``), the slow work kept off that thread (``background``), what a spawn needs (``prepare``,
``caches``), bounded output capture (``output``) and the fork server's process and socket
(``forkserver_link``).
"""
