"""Process supervision: run a task's command and own its whole process tree (DESIGN.md §5).

The runner is threaded, so it never forks task commands itself: a ``Supervisor`` (``supervisor.py``)
starts one small single-threaded fork server (``forkserver.py``) and asks it, over a Unix socket
(``link.py``, ``frames.py``), to start each command in a session of its own, to signal its tree and
to report its exit and its tree's end; **the task's tree dies with the task**. The runner's side:
``child.py`` (one command), ``reader.py`` (the one thread reading every child's output and the fork
server's events), ``chores.py`` (slow work off that thread), ``prepare.py`` and ``lookups.py`` (what
a spawn needs), ``hardening.py``, ``leftovers.py`` (the state record and the sweep of a dead runner's
trees), ``cgroups.py``. The fork server's side: ``trees.py``, ``forkexec.py``, ``_procfs.py``,
``_cgroupfs.py``. Pure: ``spec.py``, ``output.py``, ``result.py``, ``stdio_protocol.py``, ``reasons.py``.

This package exports what the rest of the code uses (``Supervisor``, ``Child``, ``CommandSpec``,
``ChildExit``, ``to_task_result``...); it must not grow logic of its own. Importing it starts no
thread; the fork server never imports it (it is booted with a stub in its place).
"""

from leasecore.process.child import Child, LineSink
from leasecore.process.result import to_task_result
from leasecore.process.spec import ChildExit, CommandSpec, build_child_env
from leasecore.process.supervisor import Supervisor

__all__ = [
    "Child",
    "ChildExit",
    "CommandSpec",
    "LineSink",
    "Supervisor",
    "build_child_env",
    "to_task_result",
]
