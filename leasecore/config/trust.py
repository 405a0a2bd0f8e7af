"""Files the server settings point at: the key secret's file and a private CA bundle; and the
config file's own mode when it holds a credential itself.

Owns: reading the secret file (mode 0600 or stricter, a regular file of bounded size), checking the
CA bundle (a file holding a PEM block, or a readable directory: looked at, not parsed), and the
warning for a config file that holds a credential where children run as another user. I/O at
configuration time (``config.loader`` calls these), so a bad file is a configuration error (exit 3)
naming the file, its source and what is allowed, before anything is polled.

Must not: let the secret's value reach a message, a log line or a ``repr``; decide precedence.
Threads: the caller's (the CLI's main thread), once per run.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from leasecore.config.settings import Source
from leasecore.errors import ConfigError

MAX_SECRET_FILE_BYTES = 64 * 1024  # a key secret is a few dozen bytes; a big file is the wrong file


def read_secret_file(path: str, source: Source) -> str:
    """The key secret held in ``path``: its text without surrounding whitespace (a trailing newline,
    as ``echo`` and most secret stores write it). The file must be private to its owner (no group or
    other permission bits: mode 0600 or 0400, as systemd credentials and a Kubernetes secret volume
    with ``defaultMode: 0400`` give); a symbolic link is followed (Kubernetes mounts them so)."""
    where = f"auth_secret_file {path} (from {source})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}", key="auth_secret_file",
                          source=str(source)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} is not a regular file", key="auth_secret_file", source=str(source))
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{where} is open to group or others (mode {mode:04o}): a secret file must be readable "
                f"by its owner only (run `chmod 600 {path}`, or 0400)",
                key="auth_secret_file",
                source=str(source),
            )
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{where} is larger than {MAX_SECRET_FILE_BYTES} bytes: is it the right file?",
                          key="auth_secret_file", source=str(source))
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text", key="auth_secret_file", source=str(source)) from None
    if not secret:
        raise ConfigError(f"{where} is empty", key="auth_secret_file", source=str(source))
    return secret


def check_ca_bundle(path: str, source: Source) -> None:
    """``path`` is a readable file holding PEM certificates (or a directory of them, as ``openssl
    rehash`` makes); ConfigError otherwise. Only looked at, not parsed: the system bundle, which
    SSL_CERT_FILE often names, takes ~20 ms to load, paid again by every TLS connection anyway
    (where a bad certificate fails with its own reason)."""
    where = f"ca_bundle {path} (from {source})"
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"cannot read {where}: permission denied", key="ca_bundle", source=str(source))
        return
    try:
        with open(path, "rb") as handle:
            found = _has_pem_block(handle)
    except OSError as exc:
        message = f"cannot read {where}: {exc.strerror}"
        raise ConfigError(message, key="ca_bundle", source=str(source)) from None
    if not found:
        raise ConfigError(f"{where} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", key="ca_bundle",
                          source=str(source))


_PEM_MARK = b"-----BEGIN "
_MAX_BUNDLE_SCAN_BYTES = 64 * 1024 * 1024


def _has_pem_block(handle: BinaryIO) -> bool:
    tail = b""
    scanned = 0
    while scanned < _MAX_BUNDLE_SCAN_BYTES:
        chunk = handle.read(1 << 16)
        if not chunk:
            return False
        if _PEM_MARK in tail + chunk:
            return True
        scanned += len(chunk)
        tail = chunk[-len(_PEM_MARK):]
    return False


# The config file keys whose value is a credential (a url with a password counts too).
FILE_SECRET_KEYS = ("auth_secret", "auth_token")


def config_file_secrets(path: str, server: Mapping[str, Any], run_as: str | None) -> str | None:
    """The rule ``read_secret_file`` applies, for a config file that holds a credential itself.

    ``server``: the file's ``[server]`` table; ``run_as``: where children run as another user (e.g.
    "task 'x' runs its children as user 'nobody' (from flag --user)"), else None. A file open to
    group or others (any of mode 0077) is refused (ConfigError) when children run as another user,
    who could then read it; otherwise it is a warning returned (any local user can read it, but the
    child, being the runner's own user, could read even a 0600 file: refusing would only break the
    many configs written with the default 0644). None when the file holds none or is private."""
    held = [key for key in FILE_SECRET_KEYS if server.get(key)]
    url = server.get("url")
    try:
        if isinstance(url, str) and urlsplit(url).password:
            held.append("a password in url")
    except ValueError:  # a malformed url: its own error comes from the url check
        pass
    if not held:
        return None
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:  # it was read a moment ago; gone now: nothing left to protect
        return None
    if not mode & 0o077:
        return None
    what = f"config file {path} holds {' and '.join(held)} and is open to group or others (mode {mode:04o})"
    fix = (f"run `chmod 600 {path}`, or give the secret by the environment ($CONDUCTOR_AUTH_SECRET, "
           "$CONDUCTOR_AUTH_TOKEN) or auth_secret_file")
    if run_as is not None:
        raise ConfigError(f"{what}, and {run_as}, who could read it: {fix}", key=held[0], source=path)
    return f"{what}: any local user can read it; {fix}"
