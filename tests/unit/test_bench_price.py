"""The price list of safety and the scale report: figures from the runs, paired within rounds."""

from __future__ import annotations

from typing import Any

import pytest

from bench import price
from bench.harness import PRICE_KINDS, WorkerConfig, worker_argv
from bench.report import _price, _scale, targets


def _runs(times: dict[str, list[float]], cpus: dict[str, list[float]]) -> dict[str, Any]:
    runs = []
    for kind, seconds in times.items():
        for round_no, (t, c) in enumerate(zip(seconds, cpus[kind], strict=True)):
            runs.append({"kind": kind, "round": round_no, "seconds": t, "worker_cpu_ms_per_task": c,
                         "root_cpu_ms_per_task": c - 1.0})  # fmt: skip
    medians = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"tasks": 1000, "concurrency": 4, "rounds": 3, "runs": runs, "median_seconds": medians,
            "median_tasks_per_second": {k: 1000 / v for k, v in medians.items()},
            "ratios": {"conductor_run_over_floor": None, "sdk_over_conductor_run": None}}  # fmt: skip


def test_a_price_is_the_full_run_minus_the_run_without_it_within_each_round() -> None:
    # Given three rounds in which the machine's speed drifts (round 2 slow for every kind)
    full = [2.0, 3.0, 2.2]
    times = {k: [t - 0.1 for t in full] for k in price.KINDS}
    times["conductor-run"] = full
    times["conductor-run-without-group"] = [t - 0.3 for t in full]
    times["conductor-run-bare"] = [t - 0.5 for t in full]
    times["conductor-run-metrics"] = [t + 0.05 for t in full]
    cpus = {k: [2.0, 2.0, 2.0] for k in price.KINDS}
    cpus["conductor-run"] = [2.5, 2.5, 2.5]
    tp = _runs(times, cpus)
    pr = price.analyse(tp)
    rows = {r["part"]: r for r in pr["parts"]}
    # Then the drift cancels: 0.3 s over 1000 tasks = 0.3 ms per task of wall, x 4 slots of slot time
    assert rows["group per tree"]["wall_ms_per_task"] == pytest.approx(0.3)
    assert rows["group per tree"]["slot_ms_per_task"] == pytest.approx(1.2)
    assert rows["group per tree"]["cpu_ms_per_task"] == pytest.approx(0.5)
    # metrics are off by default: their price is on minus off
    assert rows["metrics (when on)"]["wall_ms_per_task"] == pytest.approx(0.05)
    # the whole, and the users' answer: 0.5 ms x 4 = 2 ms of a 100 ms task's slot = 2 %
    assert rows["all of the above but metrics"]["wall_ms_per_task"] == pytest.approx(0.5)
    assert pr["percent_of_100ms_task"] == pytest.approx(2.0)
    assert pr["forkserver_cpu_ms_per_task"] == pytest.approx(1.0)
    text = "\n".join(_price({**tp, "price": pr}))
    assert "all of conductor-run's safety costs 2.0 %" in text


def test_the_targets_come_from_the_price_section_when_it_ran() -> None:
    times = {k: [2.0, 2.0, 2.0] for k in price.KINDS}
    times["floor-v2"] = [1.0, 1.0, 1.0]  # conductor-run 2 x floor-v2: missed
    tp = _runs(times, {k: [1.5, 1.5, 1.5] for k in price.KINDS})
    results = {"price": tp}
    rows = {name: (measured, verdict) for name, measured, verdict in targets(results)}
    assert rows["conductor-run time <= 1.35 x floor-v2's (a group per tree)"] == ("2.00 x", "**missed**")
    off = "conductor-run --cgroup off throughput >= 1.0 x SDK's (both on update-v2)"
    assert rows[off] == ("1.00 x", "met")
    assert rows["conductor-run CPU per task (runner + fork server) <= 2.0 ms"] == ("1.50 ms", "met")


def test_each_price_kind_is_conductor_run_without_what_it_names(tmp_path: Any) -> None:
    def argv(kind: str) -> list[str]:
        return worker_argv(WorkerConfig(kind=kind, url="http://127.0.0.1:1/api", task_type="t", concurrency=1,
                                        command=["true"], state_dir=tmp_path))  # fmt: skip

    assert argv("conductor-run-without-group")[2:4] == ["cli", "run"]
    assert argv("conductor-run-without-group")[-4:-2] == ["--cgroup", "off"]
    assert argv("conductor-run-without-files")[2:6] == ["bench.price_cli", "--without", "files", "run"]
    bare = argv("conductor-run-bare")
    assert bare[4] == "files,logstream,lease,record" and "--cgroup" in bare
    assert set(PRICE_KINDS) <= set(price.KINDS)


def test_the_scale_report_says_a_count_that_failed_and_the_slope() -> None:
    run = {"leases": 1000, "task_types": 1, "claim_spread_seconds": 3.0, "target_p99_seconds": 48.05,
           "gaps_seconds": {"count": 10, "p50": 39.6, "p99": 39.7, "max": 39.8}, "lost": 0,
           "rss_max_mb": {"runner": 48.0, "forkserver": 16.0}, "rss_max_total_mb": 64.0,
           "rss_kb_per_lease": 64.0, "open_fds_max": {"runner": 2021, "forkserver": 1013},
           "window": None}  # fmt: skip
    slope = {"from": 1000, "to": 5000, "rss_kb_per_added_lease": 23.0}
    text = "\n".join(_scale({"r_seconds": 60, "hold_seconds": 100, "budget_seconds": 600, "runs": [run],
                             "skipped": [20000], "failed": [{"leases": 10000, "error": "RuntimeError: x"}],
                             "slopes": [slope]}))  # fmt: skip
    assert "| 1000 | 3.0 |" in text and "2021, 1013" in text
    assert "10000 leases: the run failed" in text and "20000 leases" in text
    assert "23.0 KB of RSS per added lease" in text
