"""Privilege drop, end to end: a runner started as root runs each child as `--user` (setgroups, setgid, setuid
in the fork server), with HOME/USER set, its input readable and its output file writable and delivered."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from cli import exitcodes

from .helpers import World

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root can run children as another user")

NOBODY = pwd.getpwnam("nobody")

# /bin/sh (the test's Python lives where nobody may not go): who am I, can I read my input (stdin and
# the file), then the output file written as that user.
REPORT = (
    'input=$(cat "$CONDUCTOR_INPUT_FILE"); stdin=$(cat); '
    'printf \'{"uid": %s, "gid": %s, "groups": "%s", "home": "%s", "user": "%s", "logname": "%s", '
    '"input_ok": %s, "stdin_ok": %s}\' "$(id -u)" "$(id -g)" "$(id -G)" "$HOME" "$USER" "$LOGNAME" '
    '"$(case "$input" in *\'"x": "hello"\'*) echo true;; *) echo false;; esac)" '
    '"$([ "$stdin" = "$input" ] && echo true || echo false)" > "$CONDUCTOR_OUTPUT_FILE"'
)


def _config(world: World, text: str) -> Path:
    path = world.tmp / "conductor.toml"
    path.write_text(text)
    return path


def test_user_nobody_runs_the_child_as_uid_65534_and_its_output_is_delivered(world: World) -> None:
    world.define(response_timeout=30)
    workflow = world.start_workflow(x="hello")
    config = _config(world, '[worker]\ncwd = "/"\n')  # the test's own directory is root's (0700)
    proc = world.run("--config", str(config), "--once", "--user", "nobody", command=["/bin/sh", "-c", REPORT])
    code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    task = world.task_of(workflow)
    assert task["status"] == "COMPLETED", task.get("reasonForIncompletion")
    out = task["outputData"]
    assert (out["uid"], out["gid"]) == (NOBODY.pw_uid, NOBODY.pw_gid)
    assert out["groups"].split() == [str(g) for g in sorted(set(os.getgrouplist("nobody", NOBODY.pw_gid)))]
    assert (out["home"], out["user"], out["logname"]) == (NOBODY.pw_dir, "nobody", "nobody")
    assert out["input_ok"] is True and out["stdin_ok"] is True
    assert "running as root" not in err  # the one warning is for root without a user


def test_user_and_group_from_the_config_file(world: World) -> None:
    world.define(response_timeout=30)
    workflow = world.start_workflow(x="hello")
    config = _config(world, '[worker]\ncwd = "/"\nuser = "nobody"\ngroup = "0"\n')
    proc = world.run("--config", str(config), "--once", command=["/bin/sh", "-c", REPORT])
    code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    out = world.task_of(workflow)["outputData"]
    assert (out["uid"], out["gid"]) == (NOBODY.pw_uid, 0)


def test_a_cwd_the_user_may_not_enter_fails_the_task_saying_so(world: World) -> None:
    world.define(response_timeout=30)
    workflow = world.start_workflow(x="hello")
    private = world.tmp / "private"
    private.mkdir(mode=0o700)
    config = _config(world, f'[worker]\ncwd = "{private}"\n')
    proc = world.run("--config", str(config), "--once", "--user", "nobody", command=["/bin/true"])
    code, err = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, err
    reason = world.task_of(workflow)["reasonForIncompletion"]
    assert "could not start the command" in reason and "Permission denied" in reason and "chdir" in reason


def test_root_without_a_user_is_warned_once(world: World) -> None:
    world.define(response_timeout=30)
    world.start_workflow()
    proc = world.run("--once", command=["/bin/true"])
    code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    assert err.count("running as root with no user set") == 1, err


def test_an_unknown_user_is_a_config_error(world: World) -> None:
    proc = world.run("--once", "--user", "no-such-user-24", command=["/bin/true"])
    code, err = world.finish(proc)
    assert code == exitcodes.CONFIG, err
    assert "no such user 'no-such-user-24' (user from flag --user)" in err and err.count("\n") == 1
