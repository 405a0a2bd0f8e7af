"""Process supervision: run a task's command and own its whole process tree (DESIGN.md §5).

The runner is threaded, so it never forks task commands itself: a ``Supervisor`` starts one small
single-threaded fork server and asks it, over a Unix socket, to start each command in a session of
its own, to signal its tree and to report its exit and its tree's end; **the task's tree dies with
the task**. By where the code runs and what it is for: ``supervisor/`` (the runner's side: the
Supervisor, its threads, its link to the fork server), ``forkserver/`` (the fork server's process,
stdlib only), ``linux/`` (/proc, cgroups, run-as, the runner's hardening, the sweep of a dead
runner's trees) and ``results/`` (what an exit means to Conductor; pure). Shared by all of them:
``spec.py`` (what to run, what came of it, the child's environment) and ``taskfiles.py`` (a task's
input and output files).

This package exports what the rest of the code uses (``Supervisor``, ``Child``, ``CommandSpec``,
``ChildExit``, ``to_task_result``...); it must not grow logic of its own. Importing it starts no
thread; the fork server never imports it (it is booted with a stub in its place).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leasecore.process.results.task_result import to_task_result
    from leasecore.process.spec import ChildExit, CommandSpec, build_child_env
    from leasecore.process.supervisor.child import Child, LineSink
    from leasecore.process.supervisor.supervisor import Supervisor

# Each name loads its module on first use: a runner about to re-execute without its secrets
# (cli/reexec.py) needs ``spec`` alone, not the supervisor and its fork server link (start-up CPU).
_HOMES = {
    "to_task_result": "leasecore.process.results.task_result",
    "ChildExit": "leasecore.process.spec",
    "CommandSpec": "leasecore.process.spec",
    "build_child_env": "leasecore.process.spec",
    "Child": "leasecore.process.supervisor.child",
    "LineSink": "leasecore.process.supervisor.child",
    "Supervisor": "leasecore.process.supervisor.supervisor",
}

__all__ = [
    "Child",
    "ChildExit",
    "CommandSpec",
    "LineSink",
    "Supervisor",
    "build_child_env",
    "to_task_result",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value
