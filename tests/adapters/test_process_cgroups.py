"""Task trees in real cgroups (v1 controllers and the v2 hierarchy, whichever this host lets us
create), and the rlimits that stand in for them everywhere else.

The group tests skip, saying why, where the runner may not create groups (not root, no hierarchy
mounted). Every test leaves no group behind: ``no_leftover_groups`` checks after each one that no
directory named ``conductor-run.<this pid>.*`` is left under the runner's own groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from leasecore.limits import Limits
from leasecore.models import TaskStatus
from leasecore.process import CommandSpec, Supervisor, to_task_result
from leasecore.process.linux import cgroups, leftovers
from tests.daemons import Daemon, own_daemon
from tests.support import wait_until

from .process_support import REPO, alive, make_task

MB = 1 << 20
ALLOCATE_300MB = "import time; a = bytearray(300 * 1024 * 1024); time.sleep(0.1); print(len(a))"
# Forks children that sleep until it says so, counting the forks that worked, then reaps them all.
FORK_LOOP = textwrap.dedent("""
    import os, signal
    pids = []
    for _ in range(40):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            signal.pause()
            os._exit(0)
        pids.append(pid)
    print(len(pids), flush=True)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
""")


def daemon_shell(daemon: Daemon) -> str:
    """A task that starts ``daemon``, which leaves the session and wipes its environment (no marker
    token, no group, no session: nothing of /proc tracking names it), says so, and sleeps."""
    return f"setsid env -i sh -c '{daemon.shell}' & echo started; sleep 300"


# This test's own daemon command line (never another test's or another run's), killed after it.
daemon_cmd = own_daemon(3319)


def _setup(mode: str) -> cgroups.CgroupSetup:
    if os.geteuid() != 0:
        pytest.skip("cgroup tests need root (or a delegated cgroup subtree): not root here")
    try:
        return cgroups.detect(mode)
    except ValueError as exc:
        pytest.skip(f"no cgroup {mode} here: {exc}")


def _own_dirs() -> dict[str, str]:
    with open("/proc/self/cgroup") as a, open("/proc/self/mountinfo") as b:
        return cgroups.own_dirs(a.read(), b.read())


def _our_groups() -> list[str]:
    prefix = f"{cgroups.GROUP_PREFIX}{os.getpid()}."
    found = []
    for directory in set(_own_dirs().values()):
        try:
            found += [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix)]
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def no_leftover_groups() -> Iterator[None]:
    yield
    check_no_leftovers()


def check_no_leftovers() -> None:
    """After a test (its daemons killed by its ``daemon_cmd``): fail it if a group named by this
    process's pid is left."""
    left = _our_groups()
    for path in left:  # clean up whatever a failed test left, then fail it
        unified = "/unified/" in path
        kind = "unified" if unified else "x"
        leftovers._remove_when_empty({"v": 2 if unified else 1, "dirs": {kind: path}})
    assert not left, f"groups left behind: {left}"


@pytest.fixture(params=["v1", "v2"])
def setup(request: pytest.FixtureRequest) -> cgroups.CgroupSetup:
    return _setup(request.param)


def _python(code: str, **limits: int) -> CommandSpec:
    return CommandSpec(argv=(sys.executable, "-c", code), limits=Limits(**limits), kill_grace_seconds=1.0)


# --- the group itself ------------------------------------------------------------------------------


def test_each_tree_gets_a_group_nested_under_the_runners_own_and_removed_after(
    setup: cgroups.CgroupSetup,
) -> None:
    own = _own_dirs()
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        child = supervisor.spawn(make_task(), CommandSpec(shell="cat /proc/self/cgroup"), worker_id="w")
        exit_ = child.wait(20)
        assert exit_ is not None and exit_.exit_code == 0
        assert child.wait_gone(10)
    assert child.cgroup is None and not _our_groups()
    assert setup.dirs and all(own[name] == path for name, path in setup.dirs.items())
    # The child's own view: in each hierarchy of the mechanism, a direct child of the runner's group.
    with open("/proc/self/cgroup") as handle:
        mine = {line.split(":", 2)[1] or "unified": line.split(":", 2)[2] for line in handle.read().split()}
    theirs = {line.split(":", 2)[1] or "unified": line.split(":", 2)[2] for line in exit_.stdout_tail.split()}
    # v1: only the hierarchies a tree without limits needs (memory, cpuacct, freezer); pids and cpu
    # only for a pids_max / cpu_max (test_only_the_hierarchies_a_tree_needs_get_a_group).
    used = set(setup.dirs)
    if setup.mechanism == "v1":
        used &= cgroups.v1_needed(setup, Limits())
    checked = 0
    for controllers, path in theirs.items():
        names = {"unified"} if controllers == "unified" else set(controllers.split(","))
        if not names & used:
            assert path == mine[controllers]  # a hierarchy we do not use: left where it was
            continue
        parent, name = path.rsplit("/", 1)
        assert (parent or "/") == mine[controllers], (controllers, path)  # never beside the runner's
        assert name.startswith(f"{cgroups.GROUP_PREFIX}{os.getpid()}.")
        checked += 1
    assert checked == len({own[n] for n in used})


def test_the_runner_and_fork_server_stay_in_their_own_groups(setup: cgroups.CgroupSetup) -> None:
    with open("/proc/self/cgroup") as handle:
        before = handle.read()
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        with open(f"/proc/{supervisor.forkserver_pid}/cgroup") as handle:
            forkserver_before = handle.read()
        child = supervisor.spawn(make_task(), CommandSpec(argv=("true",)), worker_id="w")
        assert child.wait(20) is not None and child.wait_gone(10)
        with open(f"/proc/{supervisor.forkserver_pid}/cgroup") as handle:
            assert handle.read() == forkserver_before
    with open("/proc/self/cgroup") as handle:
        assert handle.read() == before


def test_an_env_wiped_setsid_daemon_dies_with_its_tree_on_a_fence(
    setup: cgroups.CgroupSetup, daemon_cmd: Daemon
) -> None:
    """The lease-loss path: the runner TERMs the tree, the grace passes, the group KILL takes all."""
    lines: list[str] = []
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        spec = CommandSpec(shell=daemon_shell(daemon_cmd), kill_grace_seconds=0.5)
        child = supervisor.spawn(make_task(), spec, worker_id="w", on_line=lambda _s, ln: lines.append(ln))
        assert wait_until(lambda: "started" in lines and bool(daemon_cmd.running()), 10)
        (daemon,) = daemon_cmd.running()
        assert child.cgroup is not None
        from leasecore.process.linux import cgroupfs

        assert daemon.pid in cgroupfs.members(child.cgroup)
        child.terminate_tree()
        assert child.wait_gone(10)
        assert not alive(daemon)


def test_resources_come_from_the_group(setup: cgroups.CgroupSetup) -> None:
    task = make_task()
    spec = _python("x = bytearray(40 * 1024 * 1024); sum(range(3_000_000))")
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        child = supervisor.spawn(task, spec, worker_id="w")
        exit_ = child.wait(30)
        assert exit_ is not None and child.wait_gone(10)
    resources = to_task_result(task, exit_, spec, worker_id="w").output_data["resources"]
    assert resources["max_rss_bytes"] >= 40 * MB  # the group's peak, else the child's own maxrss
    assert resources["cpu_user_seconds"] > 0 and resources["cpu_system_seconds"] is not None


def test_only_the_hierarchies_a_tree_needs_get_a_group() -> None:
    setup = _setup("v1")
    plain = cgroups.create_group(setup, "plain", Limits())
    limited = cgroups.create_group(setup, "limited", Limits(pids_max=50, cpu_max=0.5))
    try:
        assert set(plain["dirs"]) == {"memory", "cpuacct", "freezer"} & set(setup.dirs)
        assert {"pids", "cpu"} & set(setup.dirs) <= set(limited["dirs"])
        assert set(plain["dirs"]) <= set(limited["dirs"])
        if "pids" in limited["dirs"]:
            assert Path(limited["dirs"]["pids"], "pids.max").read_text().strip() == "50"
    finally:
        assert cgroups.remove_group(plain) and cgroups.remove_group(limited)


def _held_cat(gate: Path) -> CommandSpec:
    """Prints the child's groups, then waits for ``gate`` to exist: the test reads ``child.cgroup``
    before the tree can be gone (which clears it; a bare ``cat`` could be gone by then under load)."""
    script = 'cat /proc/self/cgroup; while [ ! -e "$1" ]; do sleep 0.01; done'
    return CommandSpec(argv=("sh", "-c", script, "sh", str(gate)))


def test_a_tree_without_limits_is_spawned_from_inside_its_group(
    setup: cgroups.CgroupSetup, tmp_path: Path
) -> None:
    """posix_spawn with the fork server moved in for the call: the child is a member from its birth,
    the fork server is back in its own groups right after, and a tree with a limit is not started so."""
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        pid = supervisor.forkserver_pid
        assert cgroups.spawns_inside(setup, Limits(), pid)
        assert not cgroups.spawns_inside(setup, Limits(memory_max=64 * MB), pid)
        assert not cgroups.spawns_inside(setup, Limits(pids_max=10), pid)
        assert not cgroups.spawns_inside(setup, Limits(cpu_max=1.0), pid)
        with open(f"/proc/{pid}/cgroup") as handle:
            home = handle.read()
        for i in range(3):
            gate = tmp_path / f"gate{i}"
            child = supervisor.spawn(make_task(), _held_cat(gate), worker_id="w")
            group = child.cgroup
            gate.touch()
            exit_ = child.wait(20)
            assert exit_ is not None and exit_.exit_code == 0 and group is not None
            name = os.path.basename(next(iter(group["dirs"].values())))
            assert exit_.stdout_tail.count(name) == len(set(group["dirs"].values())), exit_.stdout_tail
            assert child.wait_gone(10)
            with open(f"/proc/{pid}/cgroup") as handle:
                assert handle.read() == home


def test_a_new_fork_server_after_one_died_spawns_from_inside_too(
    setup: cgroups.CgroupSetup, tmp_path: Path
) -> None:
    """The at-home check is per fork server: the one the next spawn starts passes it again, its trees
    land in their groups, and it is back in its own groups after."""
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        first = supervisor.spawn(make_task(), CommandSpec(argv=("sleep", "30")), worker_id="w")
        assert wait_until(lambda: first.pid > 0, 10)
        old = supervisor.forkserver_pid
        os.kill(old, signal.SIGKILL)
        assert first.wait(10) is not None and first.wait_gone(10)
        child = supervisor.spawn(make_task(), _held_cat(tmp_path / "gate"), worker_id="w")
        group = child.cgroup
        (tmp_path / "gate").touch()
        exit_ = child.wait(20)
        assert supervisor.forkserver_pid != old
        assert cgroups.spawns_inside(setup, Limits(), supervisor.forkserver_pid)
        assert exit_ is not None and exit_.exit_code == 0 and group is not None
        name = os.path.basename(next(iter(group["dirs"].values())))
        assert exit_.stdout_tail.count(name) == len(set(group["dirs"].values()))
        assert child.wait_gone(10)
        assert cgroups.at_home(setup, supervisor.forkserver_pid)


def test_a_fork_server_outside_the_runners_groups_never_spawns_from_inside() -> None:
    setup = _setup("v1")
    group = cgroups.create_group(setup, "elsewhere", Limits())
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert cgroups.at_home(setup, sleeper.pid)
        Path(group["dirs"]["freezer"], "cgroup.procs").write_text(str(sleeper.pid))
        assert not cgroups.at_home(setup, sleeper.pid)
        assert not cgroups.spawns_inside(setup, Limits(), sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
        assert cgroups.remove_group(group)


INSIDE = """
import json, os, sys
from leasecore.process.linux import cgroupfs as _cgroupfs
group, gone = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def mine():
    with open("/proc/self/cgroup") as handle:
        return handle.read()
before = mine()
r, w = os.pipe()
pid = _cgroupfs.spawn_inside(group, lambda: os.posix_spawn(
    "/bin/cat", ["cat", "/proc/self/cgroup"], {}, file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)]))
os.close(w)
os.waitpid(pid, 0)
theirs = os.read(r, 65536).decode()
after = mine()
try:
    _cgroupfs.spawn_inside(gone, lambda: 0 / 0)
    failed = None
except _cgroupfs.JoinFailed as exc:
    failed = exc.step
print(json.dumps({"same": before == after, "theirs": theirs, "failed": failed, "home": mine() == before,
                  "can": _cgroupfs.can_spawn_inside()}))
"""


def test_spawn_inside_starts_the_child_in_the_group_and_moves_back(setup: cgroups.CgroupSetup) -> None:
    group = cgroups.create_group(setup, "inside", Limits())
    gone = cgroups.create_group(setup, "gone", Limits())
    assert cgroups.remove_group(gone)  # joining it fails: nothing is spawned, and the caller stays home
    try:
        out = subprocess.run([sys.executable, "-c", INSIDE, json.dumps(group), json.dumps(gone)], cwd=REPO,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        name = os.path.basename(next(iter(group["dirs"].values())))
        assert result["theirs"].count(name) == len(set(group["dirs"].values())), result["theirs"]
        assert result["same"] and result["home"] and result["can"]
        assert result["failed"] == "cgroup"
    finally:
        assert wait_until(lambda: cgroups.remove_group(group), 5)


AGAIN = """
import json, os, sys
from leasecore.process.linux import cgroupfs as _cgroupfs
group = json.loads(sys.argv[1])
def cat():
    r, w = os.pipe()
    pid = _cgroupfs.spawn_inside(group, lambda: os.posix_spawn(
        "/bin/cat", ["cat", "/proc/self/cgroup"], {}, file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)]))
    os.close(w)
    os.waitpid(pid, 0)
    return os.read(r, 65536).decode()
first, kept = cat(), sorted(_cgroupfs._JOIN_FDS)
second = cat()
removed = _cgroupfs.remove(group)
print(json.dumps({"first": first, "second": second, "kept": kept, "removed": removed,
                  "left": sorted(_cgroupfs._JOIN_FDS)}))
"""


def test_a_group_joined_again_goes_through_the_kept_file_until_it_is_removed(
    setup: cgroups.CgroupSetup,
) -> None:
    # A pooled group is joined by each tree it holds: its cgroup.procs stays open in between (one
    # write per directory, no open and close), and removing the group closes it.
    group = cgroups.create_group(setup, "again", Limits())
    try:
        out = subprocess.run([sys.executable, "-c", AGAIN, json.dumps(group)], cwd=REPO, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        name = os.path.basename(next(iter(group["dirs"].values())))
        dirs = set(group["dirs"].values())
        assert result["first"].count(name) == len(dirs) == result["second"].count(name), result
        assert result["kept"] == sorted(os.path.join(path, "cgroup.procs") for path in dirs)
        assert result["removed"] and result["left"] == []
    finally:
        cgroups.remove_group(group)


SPARED = """
import json, os, subprocess, sys, time
from leasecore.process.linux import cgroupfs as _cgroupfs
group = json.loads(sys.argv[1])
_cgroupfs.join_self(group)  # as a fork server that could not move out again
_cgroupfs._STUCK.update(_cgroupfs.paths(group))
victim = subprocess.Popen(["sleep", "30"])  # a member, born inside
assert not _cgroupfs.can_spawn_inside()
signalled = _cgroupfs.kill_all([group])
victim.wait(5)
print(json.dumps({"signalled": signalled, "victim": victim.returncode}), flush=True)
"""


def test_a_group_kill_spares_the_process_inside_it(setup: cgroups.CgroupSetup) -> None:
    """Neither the fork server stuck in a group nor one the runner names as spared is killed or frozen
    with it: the other members are."""
    group = cgroups.create_group(setup, "spared", Limits())
    try:
        out = subprocess.run([sys.executable, "-c", SPARED, json.dumps(group)], cwd=REPO, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)  # it is alive to print this: itself was spared
        assert result["victim"] == -signal.SIGKILL and result["signalled"] >= 1
        spared = subprocess.Popen(["sleep", "30"])
        victim = subprocess.Popen(["sleep", "30"])
        try:
            for pid in (spared.pid, victim.pid):
                for path in set(group["dirs"].values()):
                    Path(path, "cgroup.procs").write_text(str(pid))
            assert not cgroups.remove_group(group, spare=spared.pid)  # the spared one holds it
            assert victim.wait(5) == -signal.SIGKILL
            assert spared.poll() is None
        finally:
            spared.kill()
            spared.wait()
            victim.kill()
            victim.wait()
    finally:
        assert wait_until(lambda: cgroups.remove_group(group), 5)


# --- limits enforced by the group (v1 here: the v2 hierarchy has no controllers) ----------------------


def test_300mb_under_a_64m_group_limit_fails_naming_the_limit() -> None:
    setup = _setup("v1")
    if "memory" not in setup.limits:
        pytest.skip(f"no v1 memory controller: {setup.describe()}")
    task, spec = make_task(), _python(ALLOCATE_300MB, memory_max=64 * MB)
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        child = supervisor.spawn(task, spec, worker_id="w")
        exit_ = child.wait(60)
        assert exit_ is not None and child.wait_gone(10)
    result = to_task_result(task, exit_, spec, worker_id="w")
    assert exit_.oom_kills >= 1
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion == "memory limit 64 MiB exceeded: killed by the kernel's OOM killer"
    assert result.output_data["resources"]["max_rss_bytes"] <= 64 * MB + MB


def test_a_fork_loop_under_pids_max_16_forks_fewer_than_16() -> None:
    setup = _setup("v1")
    if "pids" not in setup.limits:
        pytest.skip(f"no v1 pids controller: {setup.describe()}")
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        child = supervisor.spawn(make_task(), _python(FORK_LOOP, pids_max=16), worker_id="w")
        exit_ = child.wait(60)
        assert exit_ is not None and child.wait_gone(10)
    assert exit_.exit_code == 0, exit_.stderr_tail
    assert 0 < int(exit_.stdout_tail) < 16  # the python itself is one of the 16


def test_cpu_max_is_written_to_the_group() -> None:
    setup = _setup("v1")
    if "cpu" not in setup.limits:
        pytest.skip(f"no v1 cpu controller: {setup.describe()}")
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        child = supervisor.spawn(make_task(), CommandSpec(shell="sleep 0.3", limits=Limits(cpu_max=0.5)),
                                 worker_id="w")  # fmt: skip
        assert wait_until(lambda: child.pid > 0, 10) and child.cgroup is not None
        quota = Path(child.cgroup["dirs"]["cpu"], "cpu.cfs_quota_us").read_text().strip()
        period = Path(child.cgroup["dirs"]["cpu"], "cpu.cfs_period_us").read_text().strip()
        assert child.wait(20) is not None and child.wait_gone(10)
    assert (quota, period) == ("50000", "100000")


# --- rlimits, with no cgroups at all (every host) ------------------------------------------------------


def test_without_groups_300mb_under_64m_fails_naming_the_rlimit() -> None:
    task, spec = make_task(), _python(ALLOCATE_300MB, memory_max=64 * MB)
    with Supervisor(None) as supervisor:
        exit_ = supervisor.spawn(task, spec, worker_id="w").wait(60)
    assert exit_ is not None
    result = to_task_result(task, exit_, spec, worker_id="w")
    assert result.status is TaskStatus.FAILED
    assert "MemoryError" in (result.reason_for_incompletion or "")
    assert "memory limit 64 MiB, a per-process rlimit" in (result.reason_for_incompletion or "")
    assert exit_.oom_kills == 0  # no group: nothing claims the OOM killer did it


def test_without_groups_nofile_and_resources_are_set() -> None:
    task = make_task()
    spec = _python("import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE))", nofile=100)
    with Supervisor(None) as supervisor:
        exit_ = supervisor.spawn(task, spec, worker_id="w").wait(30)
    assert exit_ is not None and exit_.stdout_tail.strip() == "(100, 100)"
    resources = to_task_result(task, exit_, spec, worker_id="w").output_data["resources"]
    assert resources["max_rss_bytes"] > MB  # the child's own peak (waitid's rusage)
    assert resources["cpu_user_seconds"] is not None and resources["cpu_system_seconds"] is not None


def test_without_groups_the_plain_spawn_fills_resources_too() -> None:
    task, spec = make_task(), CommandSpec(argv=("true",))
    with Supervisor(None) as supervisor:
        exit_ = supervisor.spawn(task, spec, worker_id="w").wait(30)
    assert exit_ is not None and exit_.exit_code == 0
    assert set(to_task_result(task, exit_, spec, worker_id="w").output_data["resources"]) == {
        "max_rss_bytes", "cpu_user_seconds", "cpu_system_seconds"}  # fmt: skip
    assert (exit_.resources or {}).get("max_rss_bytes", 0) > 0


def test_without_groups_pids_max_is_rlimit_nproc() -> None:
    if os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not bind root (CAP_SYS_RESOURCE): nothing to observe here")
    with Supervisor(None) as supervisor:
        exit_ = supervisor.spawn(make_task(), _python(FORK_LOOP, pids_max=16), worker_id="w").wait(60)
    assert exit_ is not None and exit_.exit_code == 0
    assert int(exit_.stdout_tail) < 16


def test_a_group_that_cannot_be_joined_fails_the_start_not_the_fork_server(
    setup: cgroups.CgroupSetup,
) -> None:
    # On v1 a tree without limits gets its group from the fork server (a reused one, or one it makes
    # right before the join: test_process_group_pool.py); a limit makes the runner make it, as here.
    limits = Limits(pids_max=1000) if setup.mechanism == "v1" else Limits()
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        original = cgroups.create_group

        def vanishing(*args: object, **kwargs: object) -> dict[str, object]:
            group = original(*args, **kwargs)  # type: ignore[arg-type]
            cgroups.remove_group(group)  # gone before the child can join it
            return group

        cgroups.create_group = vanishing  # type: ignore[assignment]
        try:
            from leasecore.errors import SpawnError

            with pytest.raises(SpawnError, match="joining its cgroup"):
                supervisor.spawn(make_task(), CommandSpec(argv=("true",), limits=limits), worker_id="w")
        finally:
            cgroups.create_group = original
        exit_ = supervisor.spawn(make_task(), CommandSpec(argv=("true",)), worker_id="w").wait(20)
        assert exit_ is not None and exit_.exit_code == 0


# --- runner and fork server SIGKILLed together: the next start's sweep walks the groups -------------------

RUNNER = """
import json, sys, time
from pathlib import Path
from leasecore.models import Task
from leasecore.process import CommandSpec, Supervisor
from leasecore.process.linux import cgroups

state_dir, mode, shell = sys.argv[1], sys.argv[2], sys.argv[3]
sup = Supervisor(Path(state_dir), cgroup_setup=cgroups.detect(mode))
lines = []
task = Task(task_id="t", workflow_id="w", task_type="x")
child = sup.spawn(task, CommandSpec(shell=shell), worker_id="w", on_line=lambda s, l: lines.append(l))
deadline = time.monotonic() + 30
while "started" not in lines and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"forkserver": sup.forkserver_pid, "leader": child.pid, "group": child.cgroup}), flush=True)
time.sleep(600)
"""


def test_a_wiped_setsid_daemon_dies_after_runner_and_fork_server_are_sigkilled(
    setup: cgroups.CgroupSetup, tmp_path: Path, daemon_cmd: Daemon
) -> None:
    state = tmp_path / "state"
    argv = [sys.executable, "-c", RUNNER, str(state), setup.mechanism, daemon_shell(daemon_cmd)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, process_group=0)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert wait_until(lambda: bool(daemon_cmd.running()), 10)
        (daemon,) = daemon_cmd.running()
        sigkill_runner_and_forkserver(proc, info["forkserver"])
        assert alive(daemon)  # re-parented to init, outside every session we know: only its group names it
        group_dirs = list(info["group"]["dirs"].values())
        assert all(os.path.isdir(path) for path in group_dirs)
        seen: list[leftovers.TreeRecord] = []
        killed = leftovers.sweep(state, lambda _pid, trees: seen.extend(trees))
        assert daemon.pid in killed
        assert wait_until(lambda: not alive(daemon), 5)
        assert not any(os.path.exists(path) for path in group_dirs)  # removed once empty
        assert [tree.survivors for tree in seen] == [0]  # every member confirmed gone
    finally:
        end_runner(proc, daemon_cmd)
        # The dead runner's pid named its groups: remove any this test left (the fixture checks ours).
        if "info" in locals() and info["group"]:
            leftovers._remove_when_empty(info["group"])


def sigkill_runner_and_forkserver(proc: subprocess.Popen[str], forkserver_pid: int) -> None:
    """Both at once: nobody is left to kill the trees. The runner is stopped first: alive, it would
    see its fork server die and kill every tree itself (as it should)."""
    forkserver = psutil.Process(forkserver_pid)
    proc.send_signal(signal.SIGSTOP)
    os.kill(forkserver_pid, signal.SIGKILL)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not alive(forkserver), 5)


def end_runner(proc: subprocess.Popen[str], daemon: Daemon) -> None:
    """A test's runner subprocess ended whatever happened, and its daemons killed."""
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    daemon.kill_all()


# A thousand sessions with a wiped environment, each ignoring TERM: a member list longer than the
# kernel's one page per read of cgroup.procs, killed through the group alone. The sleeps run the
# test's own daemon command line (argv[1]), so whatever a failure leaves is killed after it.
THOUSAND_IN_GROUP = r"""
import os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited across the exec: only KILL works
pids = [os.posix_spawn("/bin/sleep", ["sleep", sys.argv[1]], {}, setsid=True) for _ in range(1000)]
print("ready", " ".join(map(str, pids)), flush=True)
signal.pause()
"""


def test_a_group_of_a_thousand_members_is_listed_and_killed_whole(
    setup: cgroups.CgroupSetup, daemon_cmd: Daemon
) -> None:
    from leasecore.process.linux import cgroupfs

    lines: list[str] = []
    with Supervisor(None, cgroup_setup=setup) as supervisor:
        command = CommandSpec(argv=(sys.executable, "-c", THOUSAND_IN_GROUP, daemon_cmd.argv[1]),
                              kill_grace_seconds=0.5)
        child = supervisor.spawn(make_task(), command, worker_id="w",
                                 on_line=lambda _s, line: lines.append(line))  # fmt: skip
        assert wait_until(lambda: any(line.startswith("ready") for line in lines), 30)
        pids = {int(pid) for pid in next(line for line in lines if line.startswith("ready")).split()[1:]}
        assert len(pids) == 1000 and child.cgroup is not None
        assert pids | {child.pid} <= cgroupfs.members(child.cgroup)
        sessions = [psutil.Process(pid) for pid in pids]
        child.kill_tree()
        assert wait_until(lambda: not any(alive(p) for p in sessions), 2.5)
        assert child.wait_gone(10)
