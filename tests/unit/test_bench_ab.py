"""The bench's A/B kind: conductor-run from another checkout, alternating with this one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import harness
from bench.harness import BASE_KIND, WorkerConfig, worker_argv


def _cfg(kind: str) -> WorkerConfig:
    return WorkerConfig(kind=kind, url="http://127.0.0.1:1/api", task_type="t", concurrency=4,
                        command=["true"], state_dir=Path("/nonexistent"))  # fmt: skip


def test_the_base_kind_runs_the_same_command_line_from_the_other_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert worker_argv(_cfg(BASE_KIND)) == worker_argv(_cfg("conductor-run"))
    monkeypatch.setattr(harness, "BASE_CHECKOUT", None)
    with pytest.raises(ValueError, match="--base-checkout"):
        harness._checkout(BASE_KIND)
    monkeypatch.setattr(harness, "BASE_CHECKOUT", tmp_path)
    assert harness._checkout(BASE_KIND) == tmp_path
    assert harness._checkout("conductor-run") == harness.ROOT


def test_a_base_checkout_that_is_not_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.__main__ import main

    assert main(["--only", "throughput", "--base-checkout", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "not a conductor-run checkout" in capsys.readouterr().out


def test_the_base_kind_can_run_another_cgroup_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "BASE_CGROUP", "off")
    monkeypatch.setattr(harness, "CONDUCTOR_RUN_CGROUP", None)
    base, ours = worker_argv(_cfg(BASE_KIND)), worker_argv(_cfg("conductor-run"))
    assert base[base.index("--cgroup") + 1] == "off" and "--cgroup" not in ours
