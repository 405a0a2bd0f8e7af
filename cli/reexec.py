"""Secrets out of the runner's ``/proc/<pid>/environ``: re-exec without them, hand them over by pipe.

``/proc/<pid>/environ`` shows a process's environment as it was at its exec, for as long as it lives;
changing ``os.environ`` does not change it, and a child running as root reads it whatever the runner
does (PR_SET_DUMPABLE stops only other users). So when ``run`` starts with a secret in its environment
(``CONDUCTOR_AUTH_*`` and the other credential patterns of ``leasecore.process.spec``, the variables of
every sensitive configuration key, the names a task lists in ``secrets``), it

1. writes those variables to a pipe (JSON), closes the write end, and marks the read end inheritable;
2. re-executes itself (same interpreter, same arguments, same pid) with an environment without them,
   plus ``CONDUCTOR_RUN_SECRETS_FD=<fd>``;
3. the new image reads the pipe to its end, closes it, and drops the marker from ``os.environ``
   before anything else runs: the fork server (started later, with an empty environment) and the
   children never inherit the fd, and the secrets live on only in the runner's memory.

What this cannot do: root can still read the runner's memory (``/proc/<pid>/mem``, ptrace). Running
the children as another user (``--user``) is what isolates them from the runner.

Only the console entry point re-executes (``cli.main.main`` calls :func:`allow`): a ``run`` invoked
in-process (tests through typer's CliRunner) must never replace its caller's process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
from collections.abc import Iterable, Mapping, MutableMapping

from leasecore.config.keys import KEYS
from leasecore.errors import ConductorRunError, ConfigError
from leasecore.process.spec import is_secret_name

HANDOFF_ENV = "CONDUCTOR_RUN_SECRETS_FD"
_MAX_HANDOFF_BYTES = 1024 * 1024
_F_SETPIPE_SZ = 1031
_allowed = False


def allow() -> None:
    """Let ``run`` re-execute this process (only the console entry point calls this)."""
    global _allowed
    _allowed = True


def sensitive_env_names() -> frozenset[str]:
    """The environment variables of every sensitive configuration key (``auth_key``, ``auth_secret``
    and any alias added to them), on top of the credential name patterns."""
    return frozenset(name for spec in KEYS.values() if spec.sensitive for name in spec.env)


def secret_names(environ: Mapping[str, str], patterns: Iterable[str] = ()) -> list[str]:
    """The variables of ``environ`` that must not stay in the runner's exec-time environment."""
    extra = tuple(patterns)
    sensitive = sensitive_env_names()
    return sorted(name for name in environ if name in sensitive or is_secret_name(name, extra))


def receive(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The environment to resolve the configuration from: ``environ`` (default ``os.environ``) plus
    the secrets a hand-off brought, if this process is the re-executed runner. The pipe is read,
    closed and the marker removed from ``environ``, whatever happens. A marker that names no pipe of
    ours (set by hand, or inherited: ``abc``, ``77``, ``0``) is a ConfigError (exit 3), and the fd it
    names is then neither read nor closed."""
    env = os.environ if environ is None else environ
    marker = env.pop(HANDOFF_ENV, None)
    if marker is None:
        return dict(env)
    fd = _handoff_fd(marker)
    chunks: list[bytes] = []
    try:
        size = 0
        while size <= _MAX_HANDOFF_BYTES:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConductorRunError(f"cannot read the secrets handed over on fd {fd}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        handed = json.loads(b"".join(chunks))
    except ValueError:
        raise ConductorRunError(f"the secrets handed over on fd {fd} are not readable") from None
    if not isinstance(handed, dict) or not all(isinstance(v, str) for v in handed.values()):
        raise ConductorRunError(f"the secrets handed over on fd {fd} are not readable")
    return {**env, **handed}


def _handoff_fd(marker: str) -> int:
    """The pipe ``marker`` names; ConfigError, before anything is read or closed, when it names none."""
    why = None
    fd = int(marker) if marker.isascii() and marker.isdigit() else -1
    if fd < 0:
        why = "not a file descriptor number"
    elif fd <= 2:
        why = "stdin, stdout or stderr, never a hand-off"
    else:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                why = f"fd {fd} is not a pipe"
        except OSError:
            why = f"fd {fd} is not open"
        except OverflowError:  # above a C int: no process has such an fd
            why = "not a file descriptor number"
    if why is not None:
        raise ConfigError(f"{HANDOFF_ENV}={marker[:40]!r} is not a secrets hand-off ({why}): only "
                          "conductor-run's own re-exec sets it; unset it", key=HANDOFF_ENV,
                          source=f"env {HANDOFF_ENV}")  # fmt: skip
    return fd


def hand_off(patterns: Iterable[str] = (), *, argv: list[str] | None = None) -> None:
    """Re-execute without the secret variables of ``os.environ`` (see the module docstring); returns
    only when there are none, or when re-executing is not allowed (in-process) or already done.
    ``argv``: the new image's command line (default: this one's), for a caller that moved secrets from
    its command line into the hand-off (``worker stdio``'s ``--auth-secret``)."""
    if not _allowed or HANDOFF_ENV in os.environ:
        return
    names = secret_names(os.environ, patterns)
    if not names:
        return
    payload = json.dumps({name: os.environ[name] for name in names}).encode()
    if len(payload) > _MAX_HANDOFF_BYTES:
        raise ConductorRunError(f"the secret environment variables are over {_MAX_HANDOFF_BYTES} bytes")
    clean = {name: value for name, value in os.environ.items() if name not in names}
    read_fd, write_fd = os.pipe()
    try:
        if len(payload) > 60 * 1024:  # more than a default pipe holds: the write must not block
            fcntl.fcntl(write_fd, _F_SETPIPE_SZ, len(payload))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view) :]
    except OSError as exc:
        os.close(read_fd)
        why = f"cannot hand the secrets over to the re-executed runner: {exc.strerror}"
        raise ConductorRunError(why) from None
    finally:
        os.close(write_fd)
    os.set_inheritable(read_fd, True)
    clean[HANDOFF_ENV] = str(read_fd)
    if argv is None:
        argv = [sys.orig_argv[0], *sys.orig_argv[1:]] if sys.orig_argv else [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, clean)
    except OSError as exc:
        os.close(read_fd)
        raise ConductorRunError(
            f"cannot re-execute the runner without its secrets in the environment ({sys.executable}: "
            f"{exc.strerror})"
        ) from None
