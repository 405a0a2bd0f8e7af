"""What a reload may change live and what it refuses (``leasecore.config.live``, pure)."""

from __future__ import annotations

from dataclasses import replace

from leasecore.config.live import RESTART_ONLY, reload_changes
from leasecore.config.settings import ResolvedConfig, RunnerSettings, ServerSettings, Source, TaskSettings


def config(*tasks: TaskSettings, server: ServerSettings | None = None,
           runner: RunnerSettings | None = None) -> ResolvedConfig:
    return ResolvedConfig(server or ServerSettings(), runner or RunnerSettings(),
                          tasks or (TaskSettings("encode", command=("true",)),))


def test_nothing_changed_is_accepted_with_nothing_to_say() -> None:
    changes = reload_changes(config(), config())
    assert changes.accepted and changes.changed == () and changes.paused == ()


def test_task_values_are_live_and_said_with_before_and_after() -> None:
    old = config(TaskSettings("encode", command=("true",), concurrency=1, terminal_exit_codes=(2,)))
    new = config(TaskSettings("encode", command=("true",), concurrency=2, terminal_exit_codes=(2, 3),
                              memory_max=1 << 20, paused=True))
    changes = reload_changes(old, new)
    assert changes.accepted
    assert "task encode: concurrency: 1 -> 2" in changes.changed
    assert "task encode: terminal_exit_codes: [2] -> [2, 3]" in changes.changed
    assert "task encode: memory_max: none -> 1048576" in changes.changed
    assert changes.paused == (("encode", True),)


def test_a_restart_only_value_is_refused_naming_the_key_and_its_source() -> None:
    source = Source("file", "conductor.toml:2 [server]")
    new_server = ServerSettings(url="http://elsewhere:8080/api", sources={"url": source})
    new = config(TaskSettings("encode", command=("true",), concurrency=4), server=new_server)
    changes = reload_changes(config(), new)
    assert not changes.accepted
    (refusal,) = changes.refused
    assert refusal.startswith("[server] url (from conductor.toml:2 [server]) can only change with a restart")
    assert "elsewhere" not in refusal  # the values are not repeated (a URL may carry a password)


def test_credentials_are_refused_without_their_values() -> None:
    new = config(server=ServerSettings(auth_key="k2", auth_secret="s3cret"))
    changes = reload_changes(config(server=ServerSettings(auth_key="k1", auth_secret="old")), new)
    assert [r.split(" (")[0] for r in changes.refused] == ["[server] auth_key", "[server] auth_secret"]
    assert not any("s3cret" in r or "k2" in r for r in changes.refused)


def test_every_restart_only_key_of_each_scope_is_refused() -> None:
    samples = {"state_dir": "/elsewhere", "once": True, "once_wait": 1.0, "max_tasks": 3, "cgroup": "off",
               "ownership_check_rate": 1.0, "update_v2": False, "metrics_task_type_label": "task_type"}
    assert set(samples) == set(RESTART_ONLY["runner"])
    for key, value in samples.items():
        changes = reload_changes(config(), config(runner=replace(RunnerSettings(), **{key: value})))
        assert [r.split(" (")[0] for r in changes.refused] == [f"[worker] {key}"], key
    task_samples = {"user": "nobody", "group": "nogroup", "secrets": ("TOKEN",), "worker_id": "other"}
    assert set(task_samples) == set(RESTART_ONLY["task"])
    for key, value in task_samples.items():
        base = TaskSettings("encode", command=("true",))
        changes = reload_changes(config(base), config(replace(base, **{key: value})))
        assert [r.split(" (")[0] for r in changes.refused] == [f"task encode: {key}"], key


def test_log_format_drain_and_the_metrics_address_are_live_but_metrics_on_or_off_is_not() -> None:
    on = RunnerSettings(metrics_port=9464)
    moved = replace(on, metrics_port=9465, log_format="json", drain=True)
    changes = reload_changes(config(runner=on), config(runner=moved))
    assert changes.accepted
    assert set(changes.changed) == {"[worker] log_format: text -> json", "[worker] drain: False -> True",
                                    "[worker] metrics_port: 9464 -> 9465"}
    turned_off = reload_changes(config(runner=on), config(runner=RunnerSettings()))
    assert not turned_off.accepted and "turning metrics off needs a restart" in turned_off.refused[0]
    turned_on = reload_changes(config(), config(runner=on))
    assert not turned_on.accepted and "turning metrics on" in turned_on.refused[0]


def test_adding_or_removing_a_task_type_needs_a_restart() -> None:
    a, b = TaskSettings("a", command=("true",)), TaskSettings("b", command=("true",))
    added = reload_changes(config(a), config(a, b))
    assert added.refused == ("[[task]] type: the task types served can only change with a restart (added b)",)
    removed = reload_changes(config(a, b), config(a))
    assert "removed b" in removed.refused[0]


def test_a_value_that_may_be_a_credential_is_not_shown() -> None:
    old = TaskSettings("encode", command=("true",), env={"TOKEN": "one"})
    changes = reload_changes(config(old), config(replace(old, env={"TOKEN": "two"})))
    assert changes.changed == ("task encode: env: (not shown) -> (not shown)",)
