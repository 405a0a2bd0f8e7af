"""Resource limits and the cgroup mechanism, the pure parts: sizes, the keys and their sources, the
mechanism's choice (on fake hierarchies in a temporary directory), the reasons a task gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from leasecore.config.loader import ResolvedConfig, parse_toml, resolve
from leasecore.errors import ConfigError
from leasecore.limits import (
    RLIMIT_DATA,
    RLIMIT_NOFILE,
    RLIMIT_NPROC,
    Limits,
    format_size,
    memory_reason,
    parse_cpus,
    parse_size,
    rlimits_for,
)
from leasecore.models import Task, TaskStatus
from leasecore.process import CommandSpec, to_task_result
from leasecore.process.linux import cgroups
from leasecore.process.spec import ChildExit
from leasecore.state.orphans import orphan_reason

MB = 1 << 20
BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


@pytest.mark.parametrize(
    ("text", "size"),
    [("64M", 64 * MB), ("2G", 2 << 30), ("1.5G", 3 << 29), ("512K", 512 << 10), ("64MiB", 64 * MB),
     ("64mb", 64 * MB), ("1048576", MB), (4096, 4096), (" 8 M ", 8 * MB), ("1T", 1 << 40)],
)  # fmt: skip
def test_sizes(text: Any, size: int) -> None:
    assert parse_size(text) == size


BAD_SIZES = ["0", "0M", "-1", "-64M", "64X", "M", "", "1.5", "0.4K", True, 1.5, [], "2P"]


@pytest.mark.parametrize("text", BAD_SIZES)
def test_bad_sizes_say_what_is_allowed(text: Any) -> None:
    with pytest.raises(ValueError, match="a size such as 64M"):
        parse_size(text)


def test_cpus() -> None:
    assert parse_cpus("0.5") == 0.5 and parse_cpus(2) == 2.0
    for bad in (0, -1, "x", float("nan"), 0.001, True, 5000):
        with pytest.raises(ValueError, match="CPU cores"):
            parse_cpus(bad)


def test_sizes_read_back_for_people() -> None:
    assert format_size(64 * MB) == "64 MiB" and format_size(3 << 29) == "1.5 GiB"
    assert format_size(10) == "10 bytes"
    assert memory_reason(64 * MB) == "memory limit 64 MiB exceeded: killed by the kernel's OOM killer"


def test_rlimits_stand_in_only_for_what_no_group_enforces() -> None:
    limits = Limits(memory_max=64 * MB, pids_max=16, cpu_max=0.5, nofile=100)
    expected = [(RLIMIT_DATA, 64 * MB), (RLIMIT_NPROC, 16), (RLIMIT_NOFILE, 100)]
    assert rlimits_for(limits, frozenset()) == expected
    assert rlimits_for(limits, frozenset({"memory", "pids", "cpu"})) == [(RLIMIT_NOFILE, 100)]
    assert rlimits_for(Limits(), frozenset()) == []


# --- config keys -------------------------------------------------------------------------------------


def _resolve(text: str = BASE, environ: dict[str, str] | None = None, overrides: dict[str, Any] | None = None
             ) -> ResolvedConfig:  # fmt: skip
    loaded = parse_toml(text, "conductor.toml")
    return resolve(loaded, environ or {}, overrides or {}, cwd="/work", hostname="h")


def test_limit_keys_from_every_layer_with_their_sources() -> None:
    text = '[worker]\npids_max = 16\nmemory_max = "2G"\n' + BASE + 'memory_max = "64M"\n'
    config = _resolve(text, {"CONDUCTOR_WORKER_ALL_CPU_MAX": "0.5"}, {"nofile": 100})
    (task,) = config.tasks
    assert (task.memory_max, task.pids_max, task.cpu_max, task.nofile) == (64 * MB, 16, 0.5, 100)
    assert str(task.sources["memory_max"]).endswith("[[task]] 'encode'")
    assert str(task.sources["pids_max"]).endswith("[worker]")
    assert str(task.sources["cpu_max"]) == "env CONDUCTOR_WORKER_ALL_CPU_MAX (global)"
    assert str(task.sources["nofile"]) == "flag --nofile"
    task_env = _resolve(BASE, {"CONDUCTOR_WORKER_ENCODE_MEMORY_MAX": "1G"}).tasks[0]
    assert task_env.memory_max == 1 << 30
    assert _resolve().tasks[0].memory_max is None  # no limit by default
    assert _resolve().runner.cgroup == "auto"


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "expected"),
    [
        (BASE + 'memory_max = "64X"\n', {}, {}, "invalid memory_max = '64X' (from conductor.toml:4 [[task]]"),
        (BASE, {}, {"memory_max": "0"}, "invalid memory_max = '0' (from flag --memory-max)"),
        (BASE, {"CONDUCTOR_WORKER_ALL_PIDS_MAX": "-3"}, {}, "invalid pids_max = '-3' (from env"),
        (BASE + "pids_max = 0\n", {}, {}, "invalid pids_max = 0"),
        (BASE, {}, {"cpu_max": "-1"}, "invalid cpu_max = '-1' (from flag --cpu-max)"),
        (BASE, {}, {"nofile": 0}, "invalid nofile = 0 (from flag --nofile)"),
        (BASE, {"CONDUCTOR_RUN_CGROUP": "v3"}, {}, "invalid cgroup = 'v3' (from env CONDUCTOR_RUN_CGROUP)"),
    ],
)
def test_bad_limits_are_one_line_errors_naming_key_and_source(
    text: str, environ: dict[str, str], overrides: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(text, environ, overrides)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_a_forced_mechanism_that_cannot_work_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from leasecore.runner import treegroups
    def refuse(mode: str) -> cgroups.CgroupSetup:
        raise ValueError("cannot create a group in /sys/fs/cgroup/x: Permission denied")

    monkeypatch.setattr(cgroups, "detect", refuse)
    config = _resolve(BASE, {"CONDUCTOR_RUN_CGROUP": "v2"})
    with pytest.raises(ConfigError) as info:
        treegroups.setup_for(config)
    assert str(info.value) == ("cgroup = v2 (from env CONDUCTOR_RUN_CGROUP): cannot create a group in "
                               "/sys/fs/cgroup/x: Permission denied")  # fmt: skip
    assert info.value.key == "cgroup"


def test_limits_a_host_cannot_enforce_per_tree_are_warned_with_their_source() -> None:
    from leasecore.runner import treegroups
    config = _resolve(BASE + 'memory_max = "64M"\ncpu_max = 2\n')
    notes = treegroups.limit_notes(config, cgroups.CgroupSetup())
    assert notes == [
        "task type encode: memory_max (from conductor.toml:4 [[task]] 'encode') is a per-process rlimit "
        "(RLIMIT_DATA) here, not a limit of the whole tree",
        "task type encode: cpu_max (from conductor.toml:5 [[task]] 'encode') cannot be enforced here (no "
        "cgroup cpu controller): ignored",
    ]
    full = cgroups.CgroupSetup("v1", {"memory": "/x"}, frozenset({"memory", "pids", "cpu"}))
    assert treegroups.limit_notes(config, full) == []


# --- which mechanism: fake hierarchies (plain directories) ------------------------------------------


def _hierarchy(root: Path, name: str, subtree: str = "") -> Path:
    path = root / name
    path.mkdir()
    (path / "cgroup.procs").write_text("")
    (path / "cgroup.subtree_control").write_text(subtree)
    return path


def _mountinfo(root: Path, v2: bool = True, v1: tuple[str, ...] = ()) -> str:
    lines = []
    if v2:
        lines.append(f"30 25 0:26 / {root}/unified rw,relatime - cgroup2 cgroup2 rw")
    for i, name in enumerate(v1):
        lines.append(f"{40 + i} 25 0:{40 + i} / {root}/{name} rw,relatime - cgroup cgroup rw,{name}")
    return "\n".join(lines) + "\n"


V1_CGROUP = "".join(f"{i + 1}:{name}:/\n" for i, name in enumerate(cgroups.V1_CONTROLLERS)) + "0::/\n"


def test_v2_with_memory_and_pids_delegated_wins(tmp_path: Path) -> None:
    _hierarchy(tmp_path, "unified", "cpu memory pids")
    setup = cgroups.detect("auto", proc_cgroup="0::/\n", mountinfo=_mountinfo(tmp_path))
    assert setup.mechanism == "v2" and setup.limits == {"memory", "pids", "cpu"} and setup.why == ""
    assert setup.dirs == {"unified": str(tmp_path / "unified")}
    left = sorted(p.name for p in (tmp_path / "unified").iterdir())  # the probe group is gone
    assert left == ["cgroup.procs", "cgroup.subtree_control"]


def test_v2_without_controllers_gives_way_to_v1_and_says_why(tmp_path: Path) -> None:
    _hierarchy(tmp_path, "unified")
    for name in cgroups.V1_CONTROLLERS:
        _hierarchy(tmp_path, name)
    info = _mountinfo(tmp_path, v1=cgroups.V1_CONTROLLERS)
    setup = cgroups.detect("auto", proc_cgroup=V1_CGROUP, mountinfo=info)
    assert setup.mechanism == "v1" and set(setup.dirs) == set(cgroups.V1_CONTROLLERS)
    assert "gives its child groups no controller, not memory and pids" in setup.why
    assert "cgroup v1:" in setup.describe() and "not cgroup v2" in setup.describe()
    forced = cgroups.detect("v2", proc_cgroup=V1_CGROUP, mountinfo=info)  # membership and kill only
    assert forced.mechanism == "v2" and forced.limits == frozenset()


def test_the_runners_own_group_is_where_task_groups_go(tmp_path: Path) -> None:
    own = tmp_path / "memory" / "process_api" / "abc"
    own.mkdir(parents=True)
    info = _mountinfo(tmp_path, v2=False, v1=("memory",))
    dirs = cgroups.own_dirs("4:memory:/process_api/abc\n", info)
    assert dirs == {"memory": str(own)}
    # A container's namespaced mount: the mount's root is the group itself.
    inner = f"30 25 0:26 /kubepods/pod1 {tmp_path}/unified rw - cgroup2 cgroup2 rw\n"
    assert cgroups.own_dirs("0::/kubepods/pod1\n", inner) == {"unified": str(tmp_path / "unified")}
    # A mount that does not show our group is not used.
    assert cgroups.own_dirs("0::/elsewhere\n", inner) == {}


def test_nothing_usable_is_none_with_both_reasons(tmp_path: Path) -> None:
    setup = cgroups.detect("auto", proc_cgroup="0::/\n", mountinfo="")
    assert setup.mechanism == "none" and not setup.active
    assert "no cgroup v2 hierarchy" in setup.why and "not cgroup v1" in setup.why
    with pytest.raises(ValueError, match="cgroup v1 cannot be used here"):
        cgroups.detect("v1", proc_cgroup="0::/\n", mountinfo="")
    assert cgroups.detect("off").why == "cgroups are off (cgroup = off)"


# --- reasons ---------------------------------------------------------------------------------------

TASK = Task(task_id="t", workflow_id="w", task_type="x")


def test_an_oom_kill_in_the_group_names_the_limit_whatever_the_exit() -> None:
    spec = CommandSpec(argv=("x",), limits=Limits(memory_max=64 * MB))
    for exit_ in (ChildExit(None, 9, 1.0, oom_kills=1), ChildExit(137, None, 1.0, oom_kills=2)):
        result = to_task_result(TASK, exit_, spec, worker_id="w")
        assert result.status is TaskStatus.FAILED
        assert result.reason_for_incompletion == memory_reason(64 * MB)
    # A SIGKILL without the group's word for it is not called an OOM kill.
    plain = to_task_result(TASK, ChildExit(None, 9, 1.0), spec, worker_id="w")
    assert plain.reason_for_incompletion == "killed by SIGKILL"


def test_a_failure_under_a_memory_rlimit_says_the_limit_was_in_force() -> None:
    spec = CommandSpec(argv=("x",), limits=Limits(memory_max=64 * MB))
    exit_ = ChildExit(1, None, 1.0, stderr_tail="MemoryError", memory_limit_by="rlimit")
    result = to_task_result(TASK, exit_, spec, worker_id="w")
    expected = "exit code 1: MemoryError (under memory limit 64 MiB, a per-process rlimit)"
    assert result.reason_for_incompletion == expected
    ok = to_task_result(TASK, ChildExit(0, None, 1.0, memory_limit_by="rlimit"), spec, worker_id="w")
    assert ok.status is TaskStatus.COMPLETED and ok.reason_for_incompletion is None


def test_resources_are_in_every_result() -> None:
    exit_ = ChildExit(0, None, 1.0, resources={"max_rss_bytes": 5, "cpu_user_seconds": 0.1})
    output = to_task_result(TASK, exit_, CommandSpec(argv=("x",)), worker_id="w").output_data
    assert output["resources"] == {"max_rss_bytes": 5, "cpu_user_seconds": 0.1, "cpu_system_seconds": None}


def test_a_dead_runners_task_is_called_killed_only_when_no_member_survived() -> None:
    killed = "the worker running this task died (runner pid 42); its process tree was killed"
    assert orphan_reason(42) == killed
    assert orphan_reason(42, 3) == ("the worker running this task died (runner pid 42); 3 processes of its "
                                    "tree could not be killed")  # fmt: skip
    assert orphan_reason(42, 1).endswith("1 process of its tree could not be killed")
