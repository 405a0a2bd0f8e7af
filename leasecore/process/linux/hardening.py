"""What the Supervisor does to the runner process itself to keep same-user children out of it.

The runner holds the server credentials in its memory (``run`` re-executes itself without them in
its environment, ``cli/reexec.py``, so ``/proc/<pid>/environ`` does not show them even to root; the
fork server starts with an empty environment). Children run as the same user unless the spec says
``run_as``, so by default the Supervisor makes the runner non-dumpable (``PR_SET_DUMPABLE`` 0): a
same-user child can then neither read the runner's ``/proc/<pid>/mem`` nor ptrace it (root still can:
``run_as`` is the isolation from children that would run as root). The flag resets at exec, so
children themselves are unaffected. The cost: no core dumps of the runner, and debuggers or
profilers need root (CAP_SYS_PTRACE). Elsewhere than Linux, a one-time warning says what is lost.

Owns: those two process-wide calls. Must not touch: children, the fork server, files.

Threads: called once per Supervisor, on the thread that constructs it.
"""

from __future__ import annotations

import ctypes
import logging

from leasecore.process.linux import procfs

# one logger for the runner's side of process/
log = logging.getLogger("leasecore.process.supervisor.supervisor")

_PR_SET_DUMPABLE = 4
_warned_not_linux = False


def protect_from_children() -> bool:
    """Make this process non-dumpable: same-user children cannot read its environment or memory.

    Returns whether it took effect (False elsewhere than Linux).
    """
    if not procfs.IS_LINUX:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)


def warn_if_not_linux() -> None:
    """Log once per process that only process groups are killed here (no subreaper, no /proc)."""
    global _warned_not_linux
    if not procfs.IS_LINUX and not _warned_not_linux:
        _warned_not_linux = True
        log.warning(
            "not Linux: task trees are killed by process group only; descendants that leave the group "
            "and children of a killed runner may survive"
        )
