"""Process supervision: run a task's command and own its whole process tree.

Design (DESIGN.md §5). The runner is threaded, so it never forks task commands itself. A
``Supervisor`` starts one small single-threaded **fork server** (``forkserver.py``) and talks to it
over a Unix socket. The fork server

- starts each command with ``posix_spawn`` (vfork and exec in the C library: no Python runs in the
  child) in a new session (its own process group), with stdin (the input file), stdout and stderr
  (pipes) passed over SCM_RIGHTS, the signals it ignores back at default and nothing blocked;
- is a child subreaper, so descendants that leave the group (setsid, double fork) are re-parented
  to it; it reaps everything it adopts (no zombies);
- reports each exit from ``waitid`` (never from pipe EOF), but keeps the direct child unreaped until
  its whole tree is dead, so the group id it signals can never have been recycled; other processes
  are signalled only through a pidfd after re-checking their start time;
- kills leftovers when a task's direct child exits: **the task's tree dies with the task** (TERM,
  then KILL after the task's ``kill_grace_seconds``). A task's tree is: its session/group, every
  process carrying the task's random ``CONDUCTOR_RUN_TREE`` token in its environment (escapees
  keep it across setsid and double forks), and all their descendants;
- on EOF of the control socket (the runner died, even by SIGKILL) TERMs every tree, KILLs after the
  close grace (0 s when the runner died), kills anything else still below it, reaps and exits.
  If the fork server itself is killed, the Supervisor kills every tree it held, and the state
  directory's record lets the next start sweep what both left if the runner died too. The fork
  server has its own process group: a SIGKILL of the runner's group does not take it along.

Output: one thread per child reads stdout and stderr (a selector), splits lines at 64 KiB, keeps
bounded tails (200 lines / 64 KiB per stream) and calls ``on_line``. After the exit it drains the
pipes for at most ``output_drain_seconds`` (1 s) and closes them.

Elsewhere than Linux (no subreaper, pdeathsig or /proc) only process groups are killed; a warning is
logged once.

Public API::

    supervisor = Supervisor(state_dir, clock=..., environ=..., tree_meta=...)
    supervisor.sweep_leftovers(on_orphans=None) -> set[int]   # on_orphans(runner_pid, trees)
    child = supervisor.spawn(task, spec, worker_id="w1", on_line=sink)   # returns after the exec
    child = supervisor.start(task, spec, worker_id="w1", on_done=done, on_started=started)  # at once
    child.pid; child.started_at; child.exited
    child.wait(timeout) -> ChildExit | None;  child.wait_gone(timeout) -> bool
    child.terminate_tree(grace_seconds=None); child.kill_tree()
    supervisor.close(grace_seconds=0.0)
    to_task_result(task, exit, spec, worker_id=..., timed_out=False) -> TaskResult
"""

from leasecore.process.result import to_task_result
from leasecore.process.spec import ChildExit, CommandSpec, build_child_env
from leasecore.process.supervisor import Child, LineSink, Supervisor

__all__ = [
    "Child",
    "ChildExit",
    "CommandSpec",
    "LineSink",
    "Supervisor",
    "build_child_env",
    "to_task_result",
]
