"""Resolving --user / --group, and when a runner may not switch users."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest

from leasecore.config.loader import TaskSettings, run_as_problems
from leasecore.config.settings import Source
from leasecore.process.linux.runas import RunAs, resolve_run_as, switch_problem

NOBODY = pwd.getpwnam("nobody")


def test_a_user_by_name_or_uid_with_its_groups_and_home() -> None:
    by_name = resolve_run_as("nobody")
    assert (by_name.uid, by_name.gid, by_name.home, by_name.user) == (
        NOBODY.pw_uid, NOBODY.pw_gid, NOBODY.pw_dir, "nobody")
    assert NOBODY.pw_gid in by_name.groups
    assert resolve_run_as(str(NOBODY.pw_uid)) == by_name
    assert resolve_run_as("nobody", "0").gid == 0
    assert by_name.env() == {"HOME": NOBODY.pw_dir, "USER": "nobody", "LOGNAME": "nobody"}
    assert by_name.wire() == {"uid": by_name.uid, "gid": by_name.gid, "groups": list(by_name.groups)}


def test_a_uid_without_a_name_is_allowed() -> None:
    uid = 4242424
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    assert resolve_run_as(str(uid)) == RunAs(user=str(uid), uid=uid, gid=uid, groups=(uid,), home="/")


@pytest.mark.parametrize(("user", "group", "expected"), [
    ("no-such-user-24", None, "no such user 'no-such-user-24'"),
    ("nobody", "no-such-group-24", "no such group 'no-such-group-24'"),
    # No uid or gid is this large: taken as a number, it failed later (a chown's OverflowError on the
    # first task, which then stayed IN_PROGRESS; setgroups' EINVAL for the all-ones "no id").
    ("99999999999999999999", None, r"uid 99999999999999999999 is out of range \(0 to 4294967294\)"),
    ("4294967295", None, r"uid 4294967295 is out of range"),
    ("nobody", "99999999999999999999", r"gid 99999999999999999999 is out of range"),
    ("nobody", "4294967295", r"gid 4294967295 is out of range"),
])
def test_unknown_names_are_errors(user: str, group: str | None, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        resolve_run_as(user, group)


def test_only_root_may_switch_users(monkeypatch: pytest.MonkeyPatch) -> None:
    nobody = resolve_run_as("nobody")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert switch_problem(nobody) is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    problem = switch_problem(nobody)
    assert problem is not None and "only a runner started as root can switch users" in problem
    assert switch_problem(RunAs("me", 1000, 1000, (1000,), "/home/me")) is None  # already that user
    other_group = switch_problem(RunAs("me", 1000, 0, (0,), "/home/me"))  # the user's own, another group
    assert other_group is not None and other_group.startswith("cannot run tasks with group gid 0")


def test_the_largest_ids_are_still_accepted() -> None:
    assert resolve_run_as("4294967294", "4294967294").gid == 4294967294


def test_config_problems_name_the_key_and_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    task = TaskSettings(type="t", user="nobody", sources={})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    (problem,) = run_as_problems(task)
    assert problem.startswith("task 't': cannot run tasks as user 'nobody'")
    assert run_as_problems(TaskSettings(type="t")) == []
    (alone,) = run_as_problems(TaskSettings(type="t", group="nogroup"))
    assert "group is set" in alone and "without user" in alone
    # Its own user with another group: the group is what it may not switch to, and what is named.
    flags = {"user": Source("flag", "flag --user"), "group": Source("flag", "flag --group")}
    (group_problem,) = run_as_problems(TaskSettings(type="t", user="1000", group="0", sources=flags))
    assert "cannot run tasks with group gid 0" in group_problem
    assert "(group from flag --group)" in group_problem
    # Which key is at fault comes with the error, not from its words: a user named "...group..."
    # was blamed on group.
    (named,) = run_as_problems(TaskSettings(type="t", user="no-group-user-24", sources=flags))
    assert "no such user 'no-group-user-24' (user from flag --user): expected a user name or uid" in named
    huge = TaskSettings(type="t", user="nobody", group="99999999999999999999", sources=flags)
    (range_problem,) = run_as_problems(huge)
    assert "gid 99999999999999999999 is out of range" in range_problem
    assert "(group from flag --group)" in range_problem


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_cwd_or_program_the_user_cannot_reach_is_warned() -> None:
    base = Path(tempfile.mkdtemp(prefix="runas-", dir="/tmp"))  # pytest's own tmp is root's 0700
    base.chmod(0o755)
    try:
        _check_access_warnings(base)
    finally:
        shutil.rmtree(base)


def _check_access_warnings(tmp_path: Path) -> None:
    from leasecore.config.loader import load_config
    from leasecore.process.linux.runas import access_problem

    nobody = resolve_run_as("nobody")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert access_problem(nobody, "/", "/bin/true") is None
    problem = access_problem(nobody, str(private), None)
    assert problem is not None and f"{private} is mode 0700" in problem
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    script = open_dir / "job.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o744)  # the owner (root) may run it, nobody may not
    problem = access_problem(nobody, str(open_dir), "./job.sh")
    assert problem is not None and f"may not run {script}" in problem
    os.chown(script, nobody.uid, nobody.gid)
    assert access_problem(nobody, str(open_dir), "./job.sh") is None
    config = load_config({"task_type": "t", "command": ["/bin/true"], "user": "nobody"}, {}, str(private),
                         hostname="h")
    assert any("may not enter its working directory" in w and "will fail to start" in w
               for w in config.warnings)
