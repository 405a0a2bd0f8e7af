"""Who a task's child runs as (a privilege drop): ``RunAs``, resolved from ``user`` / ``group`` names or ids.

Owns the lookup in the password and group databases (``resolve_run_as``: uid, gid, the user's
supplementary groups from ``os.getgrouplist``, HOME; ``RunAs.env`` gives HOME and USER/LOGNAME,
``RunAs.wire`` what a spawn request carries) and two checks made once, at configuration time:
``switch_problem`` (a runner that is not root cannot switch users: a ``user`` other than its own is
a configuration error there) and ``access_problem`` (the permission bits that would surely keep the
user out of its working directory or program; ACLs are not read, so it only warns).

Must not touch: the switch itself, which the fork server does (``forkexec.py``: setgroups, setgid,
setuid in the child), and any process or file: it only reads the databases and stats paths.

Threads: the configuration loader's (``config/loader.py``) and the run's wiring, at start.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from typing import Any

# A uid or gid is a 32-bit unsigned number, and its all-ones value means "no id" to setuid/setgid/chown.
MAX_ID = 2**32 - 2


class RunAsError(ValueError):
    """A ``user`` or ``group`` that names no one here; ``key`` says which of the two."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class RunAs:
    """A resolved user to run children as."""

    user: str  # the name (or the uid as text when the database has no name for it)
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def env(self) -> dict[str, str]:
        """What the child's environment says about who it is."""
        return {"HOME": self.home, "USER": self.user, "LOGNAME": self.user}

    def wire(self) -> dict[str, Any]:
        """The part the fork server needs (a spawn request's ``run_as``)."""
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups)}


def resolve_run_as(user: str, group: str | None = None) -> RunAs:
    """``user`` (a name or a numeric uid) and ``group`` (name or gid; default: the user's primary
    group); RunAsError saying what is wrong, and which of the two."""
    entry = _user_entry(user)
    if entry is not None:
        name, uid, gid, home = entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/"
    elif _is_number(user):  # a uid without a name (containers often have no passwd entry for it)
        uid = _numeric_id(user, "user", "uid")
        name, gid, home = user, uid, "/"
    else:
        raise RunAsError("user", f"no such user {user!r}")
    if group is not None:
        gid = _group_id(group)
    try:
        groups = sorted(set(os.getgrouplist(name, gid))) if entry is not None else [gid]
    except OSError:
        groups = [gid]
    return RunAs(user=name, uid=uid, gid=gid, groups=tuple(groups), home=home)


def switch_problem(run_as: RunAs) -> str | None:
    """Why this process cannot run children as ``run_as`` (None: it can)."""
    if os.geteuid() == 0:
        return None
    if run_as.uid == os.geteuid() and run_as.gid == os.getegid():
        return None  # already that user: nothing to switch
    if run_as.uid == os.geteuid():
        return (f"cannot run tasks with group gid {run_as.gid}: only a runner started as root can switch "
                f"groups (this one runs as uid {os.geteuid()}, gid {os.getegid()}); drop group/--group, "
                "or start conductor-run as root")
    return (f"cannot run tasks as user {run_as.user!r}: only a runner started as root can switch users "
            f"(this one runs as uid {os.geteuid()}); drop user/--user, or start conductor-run as root")


def access_problem(run_as: RunAs, cwd: str, program: str | None) -> str | None:
    """Why ``run_as`` surely cannot enter ``cwd`` or run ``program`` (a path; a bare name is looked
    up on PATH at each start and not checked here), from the permission bits (ACLs are not read, so
    this only warns); None when nothing is in the way."""
    if run_as.uid == 0:
        return None
    blocked = _first_blocked(run_as, cwd)
    if blocked is not None:
        return f"user {run_as.user!r} may not enter its working directory {cwd} ({blocked})"
    if program is not None and "/" in program:
        path = os.path.normpath(os.path.join(cwd, program))
        blocked = _first_blocked(run_as, path)
        if blocked is not None:
            return f"user {run_as.user!r} may not run {path} ({blocked})"
    return None


def _first_blocked(run_as: RunAs, path: str) -> str | None:
    """The first component of ``path`` the user lacks x on (search for a directory, exec for the file)."""
    parts = os.path.abspath(path).split(os.sep)
    for depth in range(1, len(parts) + 1):
        current = os.sep + os.path.join(*parts[1:depth]) if depth > 1 else os.sep
        try:
            st = os.stat(current)
        except OSError:
            return None  # missing: the runner's own checks say so
        if not _may_execute(run_as, st):
            owner = f"owner uid {st.st_uid}, group gid {st.st_gid}"
            return f"{current} is mode {stat.S_IMODE(st.st_mode):04o}, {owner}"
    return None


def _may_execute(run_as: RunAs, st: os.stat_result) -> bool:
    if st.st_uid == run_as.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == run_as.gid or st.st_gid in run_as.groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _numeric_id(text: str, key: str, what: str) -> int:
    """A uid or gid given as a number; RunAsError when no process or file could have it."""
    number = int(text)
    if number > MAX_ID:
        raise RunAsError(key, f"{what} {text} is out of range (0 to {MAX_ID})")
    return number


def _user_entry(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(int(user)) if _is_number(user) else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        return None


def _group_id(group: str) -> int:
    if _is_number(group):
        return _numeric_id(group, "group", "gid")
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise RunAsError("group", f"no such group {group!r}") from None
