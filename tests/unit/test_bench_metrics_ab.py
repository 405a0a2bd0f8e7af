"""The metrics A/B's arithmetic and its report lines (bench/metrics_ab.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import metrics_ab
from bench.report import _metrics_ab


def _run(kind: str, round_no: int, seconds: float, cpu: float, run_cpu: float | None,
         start: float | None) -> dict[str, Any]:
    return {"kind": kind, "round": round_no, "seconds": seconds, "worker_cpu_ms_per_task": cpu,
            "worker_run_cpu_ms_per_task": run_cpu, "worker_start_cpu_ms": start}


def test_ratios_of_medians_and_per_round_for_time_cpu_and_run_cpu() -> None:
    on, off = metrics_ab.ON, metrics_ab.OFF
    runs = [
        _run(off, 0, 2.0, 3.0, 2.5, 200.0), _run(on, 0, 2.2, 3.3, 2.6, 230.0),
        _run(on, 1, 1.8, 2.7, 2.4, 250.0), _run(off, 1, 2.0, 3.0, 2.5, 220.0),
        _run(off, 2, 4.0, 6.0, None, None), _run(on, 2, 4.0, 6.6, None, None),  # no start-up mark
        _run(on, 3, 9.9, 9.9, 9.9, 999.0),  # its off run is missing: no per-round ratio
    ]
    ab = metrics_ab.ratios(runs)
    assert [round(x, 6) for x in ab["time_on_over_off_per_round"]] == [1.1, 0.9, 1.0]
    # The medians' ratio takes every run, round 3's too: on (1.8, 2.2, 4.0, 9.9) -> 3.1, off -> 2.0.
    assert round(ab["time_on_over_off"], 6) == 1.55
    assert round(ab["time_per_round_median"], 6) == 1.0
    assert [round(x, 6) for x in ab["cpu_on_over_off_per_round"]] == [1.1, 0.9, 1.1]
    assert [round(x, 6) for x in ab["run_cpu_on_over_off_per_round"]] == [1.04, 0.96]
    assert round(ab["run_cpu_per_round_median"], 6) == 1.0
    assert ab["start_cpu_ms"] == {on: 250.0, off: 210.0}


def test_the_report_gives_every_ratio_and_round(tmp_path: Path) -> None:
    on, off = metrics_ab.ON, metrics_ab.OFF
    runs = [_run(off, 0, 2.0, 3.0, 2.5, 200.0), _run(on, 0, 2.1, 3.1, 2.55, 230.0)]
    lines = "\n".join(_metrics_ab(metrics_ab.ratios(runs)))
    assert "| time (first claim to last update) | 1.050 | 1.050 | 1.050 |" in lines
    assert "| worker CPU per task, start-up included | 1.033 | 1.033 | 1.033 |" in lines
    assert '| worker CPU per task after "serving" (the run alone) | 1.020 | 1.020 | 1.020 |' in lines
    assert 'Start-up CPU (until "serving"), medians: metrics on 230 ms, off 200 ms.' in lines
    assert _metrics_ab(None) == []


def test_the_start_up_mark_is_the_workers_cpu_once_its_log_says_serving(tmp_path: Path) -> None:
    import os

    log = tmp_path / "w.log"
    log.write_bytes(b"2026-12-02 INFO    checking the server\n")
    assert metrics_ab.cpu_at_serving(os.getpid(), log, timeout_seconds=0.05) is None
    log.write_bytes(b"2026-12-02 INFO    serving t on http://127.0.0.1:1/api as w\n")
    cpu = metrics_ab.cpu_at_serving(os.getpid(), log, timeout_seconds=5)
    assert cpu is not None and cpu > 0
