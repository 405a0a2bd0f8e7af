"""A start on the fork server's main thread, made while a spawner thread's start waits inside its own
v1 group, moves neither that thread nor its command: each tree is born in its own group.

A spawner thread joins its tree's group (the v1 ``tasks`` files) and starts its command without the
fork server's lock; a start on the main thread that joined its group through ``cgroup.procs`` would
move every thread of the process, that spawner thread with them, so the spawner's command would be
born in the other tree's group (or at home, once the main thread moved back). The trees' own
/proc/self/cgroup is what this checks. Skipped (saying why) where v1 groups cannot be made here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.process import CommandSpec, Supervisor
from tests.support import wait_until

from .process_support import forkserver_boot_around_spawn, make_task
from .test_process_cgroups import _setup, check_no_leftovers


@pytest.fixture(autouse=True)
def no_leftover_groups() -> Iterator[None]:
    yield
    check_no_leftovers()


def test_a_main_thread_start_leaves_a_waiting_spawner_thread_and_its_command_in_their_group(
    tmp_path: Path,
) -> None:
    v1 = _setup("v1")
    gate = tmp_path / "gate"
    # Every start on a spawner thread but each second one, a probe on the main thread; a start whose
    # argv says "held" waits (inside its group, before libc's posix_spawn) for the gate.
    boot = forkserver_boot_around_spawn(
        f"while 'held' in argv and not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)", threads=None
    ).replace(
        "from leasecore.process.forkserver.server import main\n",
        "import leasecore.process.forkserver.launch as _starts\n"
        "_starts._THREADS_ABOVE_SECONDS = -1.0\n_starts._PROBE_EVERY = 2\n"
        "from leasecore.process.forkserver.server import main\n",
    )
    with Supervisor(None, cgroup_setup=v1, forkserver_boot=boot) as supervisor:
        forkserver = supervisor.forkserver_pid
        home = Path(f"/proc/{forkserver}/cgroup").read_text()

        def threads() -> dict[int, str]:
            tasks = Path(f"/proc/{forkserver}/task")
            return {int(tid.name): (tid / "cgroup").read_text() for tid in tasks.iterdir()}

        started: dict[str, dict[str, object] | None] = {}
        printed: dict[str, list[str]] = {"held": [], "probe": []}

        def start(name: str, argv: tuple[str, ...]):  # type: ignore[no-untyped-def]
            return supervisor.start(
                make_task(), CommandSpec(argv=argv), worker_id="w",
                on_lines=lambda _s, got: printed[name].extend(got),
                on_started=lambda answer: started.__setitem__(name, answer.cgroup),
            )  # fmt: skip

        held = start("held", ("sh", "-c", "cat /proc/self/cgroup", "held"))
        assert wait_until(lambda: any(text != home for text in threads().values()), 10)
        waiting = {tid: text for tid, text in threads().items() if text != home}
        assert len(waiting) == 1 and forkserver not in waiting  # a spawner thread, inside its group
        probe = start("probe", ("cat", "/proc/self/cgroup"))  # the second start: on the main thread
        probe_exit = probe.wait(30)
        assert probe_exit is not None and probe_exit.exit_code == 0, probe_exit
        assert {tid: text for tid, text in threads().items() if text != home} == waiting  # not moved
        assert threads()[forkserver] == home  # the main thread is back home
        gate.touch()
        held_exit = held.wait(30)
        assert held_exit is not None and held_exit.exit_code == 0, held_exit
        assert held.wait_gone(10) and probe.wait_gone(10)
        assert all(text == home for text in threads().values())
    names = {}
    for name in ("held", "probe"):
        group = started[name]
        assert group is not None
        dirs = set(group["dirs"].values())  # type: ignore[attr-defined]
        names[name] = {path.rsplit("/", 1)[1] for path in dirs}
        # every hierarchy the tree has a group in lists that group in its own /proc/self/cgroup
        assert sum(any(n in line for n in names[name]) for line in printed[name]) == len(dirs), printed[name]
    assert names["held"].isdisjoint(names["probe"])
    assert not any(n in line for n in names["probe"] for line in printed["held"])
