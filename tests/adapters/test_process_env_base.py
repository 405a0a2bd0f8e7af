"""A spawn's environment sent as a base (once per fork server) plus what differs: the child still
gets exactly the environment it would get whole, across many specs and a fork server's restart."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.process import CommandSpec, Supervisor
from leasecore.process.supervisor import forkserver_link
from tests.support import wait_until

from .process_support import make_task, running_supervisor, sample, spec

ENV_DUMP = 'env -0 > "$DUMP_DIR/$CONDUCTOR_TASK_ID.env"'


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def _child_env(supervisor: Supervisor, command: CommandSpec, task_id: str, dump_dir: Path) -> dict[str, str]:
    """The environment the child of ``command`` saw (it writes ``env -0`` to ``dump_dir``)."""
    child = supervisor.spawn(make_task({"colour": task_id}, task_id=task_id), command, worker_id="w")
    exit_ = child.wait(30)
    assert exit_ is not None and exit_.exit_code == 0, exit_
    dumped: dict[str, str] = {}
    for entry in (dump_dir / f"{task_id}.env").read_bytes().split(b"\0"):
        if entry:
            name, _, value = entry.decode().partition("=")
            dumped[name] = value
    return dumped


def test_the_child_gets_the_whole_environment_from_a_base_and_its_differences(
    supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Few bases kept: the link forgets and sends them again under new numbers as specs come and go.
    monkeypatch.setattr(forkserver_link, "ENV_BASES_MOST", 2)
    specs = [CommandSpec(shell=ENV_DUMP, env={"FLAVOUR": f"f{i}", "DUMP_DIR": str(tmp_path),
                                                     "CONDUCTOR_DEADLINE": "stale"})
             for i in range(3)]  # fmt: skip
    for round_no in range(2):
        for i, command in enumerate(specs):
            task_id = f"r{round_no}-s{i}"
            env = _child_env(supervisor, command, task_id, tmp_path)
            assert env["FLAVOUR"] == f"f{i}"
            assert env["PATH"] == os.environ["PATH"]  # from the base
            assert env["CONDUCTOR_TASK_ID"] == task_id
            assert "CONDUCTOR_DEADLINE" not in env  # in the base, left out of this spawn (no deadline)
            assert env["CONDUCTOR_INPUT_COLOUR"] == task_id
            assert env["CONDUCTOR_OUTPUT_FILE"].endswith("output.json")
        if round_no == 0:  # the next round goes to a new fork server, which was sent no base yet
            os.kill(supervisor.forkserver_pid, 9)
            assert wait_until(lambda: not supervisor.forkserver_up, 10)


def test_a_spawn_naming_an_unknown_base_fails_and_the_fork_server_goes_on(supervisor: Supervisor) -> None:
    link = supervisor._link
    real = link.send_spawn

    def forgetful(message: dict[str, object], fds: list[int], base: dict[str, str]) -> None:
        link._bases.clear()
        link._base_numbers += 1000  # a number the fork server was never sent
        with link._send_lock:
            link._bases[id(base)] = (base, link._base_numbers)
        real(message, fds, base)

    link.send_spawn = forgetful  # type: ignore[method-assign]
    with pytest.raises(Exception, match="while doing env"):
        supervisor.spawn(make_task(), spec("true"), worker_id="w")
    link.send_spawn = real  # type: ignore[method-assign]
    link._bases.clear()
    after = supervisor.spawn(make_task(task_id="after"), spec(*sample("echo_input.py")), worker_id="w")
    exit_ = after.wait(30)
    assert exit_ is not None and exit_.exit_code == 0, exit_
