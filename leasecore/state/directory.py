"""The state directory: where it is, and the one object that owns it once it is made and checked.

Owns: :func:`default_state_dir` (``$CONDUCTOR_RUN_STATE_DIR``, else ``$XDG_RUNTIME_DIR/conductor-run``,
else ``~/.local/state/conductor-run``), :func:`check_state_dir` (private to this user: owned by it,
writable by no one else; a shared directory such as /tmp is refused, never chmod-ed),
:func:`ensure_state_dir` (created 0700 when missing, then checked), and :class:`StateDir`: a
directory that has been made and checked, handed on as it is to everything that keeps files there
(the status publisher and readers, ``state.statefile``; the outbox, ``state.outbox``, and the orphans'
reports in it; the supervisor's tree records), so that a run checks its directory once.

Must not: read or write the files inside (each of those modules owns its own), log, or print.
Threads: the caller's; a ``StateDir`` is an immutable value, shared freely.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from leasecore.errors import ConfigError

__all__ = ["StateDir", "check_state_dir", "default_state_dir", "ensure_state_dir", "state_dir_missing"]


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """``$CONDUCTOR_RUN_STATE_DIR``, else ``$XDG_RUNTIME_DIR/conductor-run``, else ``~/.local/state/...``."""
    explicit = environ.get("CONDUCTOR_RUN_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "conductor-run"
    home = environ.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "state" / "conductor-run"


def check_state_dir(path: Path) -> None:
    """Refuse a state directory another user owns or that others may write: snapshots are private."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot use state directory {path}: {exc.strerror}", key="state_dir") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"state directory {path} is not a directory", key="state_dir")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"state directory {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
            "use --state-dir or CONDUCTOR_RUN_STATE_DIR to pick a private directory",
            key="state_dir",
        )
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        if st.st_mode & (stat.S_ISVTX | 0o002):
            # A shared directory (/tmp, /var/tmp, /dev/shm: sticky or world-writable) must keep its mode:
            # never suggest changing it; a private directory of its own is the fix.
            fix = ("it is a shared directory: pick a private one with --state-dir or CONDUCTOR_RUN_STATE_DIR "
                   "(for example ~/.local/state/conductor-run; created 0700 when missing)")
        else:
            fix = f"run `chmod 700 {path}` if it is this runner's own, or pick another with --state-dir"
        raise ConfigError(
            f"state directory {path} is writable by group or others (mode {mode:04o}); {fix}",
            key="state_dir",
        )


def state_dir_missing(path: Path) -> bool:
    """Whether nothing is at ``path``. One that cannot be looked at (a parent this user may not enter:
    ``Path.exists`` raises there) is not missing: :func:`check_state_dir` then says why, as a
    configuration error, instead of a traceback."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def ensure_state_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) when missing, then :func:`check_state_dir` it."""
    if state_dir_missing(path):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.chmod(0o700)  # mkdir's mode is filtered by the umask
        except OSError as exc:
            msg = f"cannot create state directory {path}: {exc.strerror}"
            raise ConfigError(msg, key="state_dir") from exc
    check_state_dir(path)
    return path


@dataclass(frozen=True, eq=False)
class StateDir:
    """A state directory made (0700) and checked: make one with :meth:`open` (or :meth:`for_run`),
    then hand it on; whoever receives one uses ``path`` as it is, without checking it again."""

    path: Path

    @classmethod
    def open(cls, path: Path) -> StateDir:
        """``path`` created when missing and checked (``ConfigError`` naming ``state_dir``: exit 3)."""
        return cls(ensure_state_dir(path))

    @classmethod
    def for_run(cls, configured: str | None, environ: Mapping[str, str]) -> StateDir:
        """The run's directory: ``[worker] state_dir`` / ``--state-dir`` when set, else the default."""
        return cls.open(Path(configured) if configured else default_state_dir(environ))

    @property
    def outbox(self) -> Path:
        """Where undelivered results wait (``state.outbox.Outbox``; created by its first save)."""
        return self.path / "outbox"
