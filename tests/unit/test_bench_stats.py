"""The bench's pure parts: percentiles, lease-confirmation gaps, ratios and the report's verdicts."""

from __future__ import annotations

import os

import pytest

from bench.measure import CpuSampler, machine_jiffies, steal_share
from bench.report import render, targets
from bench.stats import confirmation_gaps, percentile, ratio, summary


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summary_of_nothing_is_all_none() -> None:
    assert summary([]) == {"count": 0, "p50": None, "p99": None, "max": None}


def test_gaps_count_the_claim_and_ignore_confirmations_after_the_final_update() -> None:
    # Given a claim at 10, heartbeats at 11.6, 13.2 and a late one at 20 after the report at 14
    gaps = confirmation_gaps([10.0], [13.2, 11.6, 20.0], end=14.0)
    # Then only the two gaps while the task was ours count
    assert gaps == pytest.approx([1.6, 1.6])


def test_a_redelivery_claim_is_a_confirmation_too() -> None:
    assert confirmation_gaps([0.0, 1.0], [2.5], end=None) == pytest.approx([1.0, 1.5])


def test_ratio_of_missing_figures_is_none() -> None:
    assert ratio(None, 2.0) is None
    assert ratio(3.0, 0.0) is None
    assert ratio(3.0, 2.0) == pytest.approx(1.5)


def _results() -> dict[str, object]:
    return {
        "started_at": "2026-01-01T00:00:00Z",
        "wall_seconds": 1.0,
        "command_line": "python -m bench",
        "machine": {
            "cpu_model": "cpu",
            "cores": 2,
            "physical_cores": 2,
            "memory_gb": 4.0,
            "os": "Linux",
            "python": "3.11",
            "load_average_at_start": [0.1, 0.1, 0.1],
        },
        "versions": {"conductor-run": "0.1.0", "conductor-python": "2.0.0", "psutil": "7"},
        "throughput": {
            "tasks": 10,
            "concurrency": 2,
            "rounds": 1,
            "runs": [
                {"kind": "conductor-run", "seconds": 1.1},
                {"kind": "floor", "seconds": 1.0},
                {"kind": "sdk", "seconds": 1.5},
                {"kind": "floor-v2", "seconds": 0.8},
                {"kind": "conductor-run-without-group", "seconds": 1.6},
            ],
            "median_seconds": {"conductor-run": 1.1, "floor": 1.0, "sdk": 1.5, "floor-v2": 0.8,
                               "conductor-run-without-group": 1.6},
            "median_tasks_per_second": {"conductor-run": 9.1, "floor": 10.0, "sdk": 6.7, "floor-v2": 12.5,
                                        "conductor-run-without-group": 6.25},
            "ratios": {"conductor_run_over_floor": 1.1, "sdk_over_conductor_run": 1.5 / 1.1},
        },
        "heartbeat": {
            "hold_factor": 3.2,
            "runs": [
                {
                    "kind": "conductor-run",
                    "leases": 1000,
                    "r_seconds": 2,
                    "target_p99_seconds": 1.65,
                    "gaps_seconds": {"count": 3, "p50": 1.6, "p99": 1.61, "max": 1.62},
                    "lost": 0,
                    "statuses": {"COMPLETED": 1000},
                },
                {
                    "kind": "conductor-run",
                    "leases": 40,
                    "r_seconds": 2,
                    "target_p99_seconds": 1.65,
                    "gaps_seconds": {"count": 3, "p50": 1.6, "p99": 1.9, "max": 1.9},
                    "lost": 1,
                    "statuses": {"TIMED_OUT": 1},
                },
            ],
        },
    }


def test_targets_say_met_or_missed_from_the_figures() -> None:
    rows = {name: verdict for name, _, verdict in targets(_results())}
    # Against floor-v2: 1.1 / 0.8 = 1.375 x its time misses <= 1.35; --cgroup off at 1.6 s against
    # the SDK's 1.5 s is 0.94 x its throughput, which misses >= 1.0.
    assert rows["conductor-run time <= 1.35 x floor-v2's (a group per tree)"] == "**missed**"
    assert rows["conductor-run --cgroup off throughput >= 1.0 x SDK's (both on update-v2)"] == "**missed**"
    results = _results()
    results["throughput"]["median_seconds"].update({"floor-v2": 0.9, "conductor-run-without-group": 1.4})
    rows = {name: verdict for name, _, verdict in targets(results)}
    assert rows["conductor-run time <= 1.35 x floor-v2's (a group per tree)"] == "met"  # 1.22 x
    assert rows["conductor-run --cgroup off throughput >= 1.0 x SDK's (both on update-v2)"] == "met"  # 1.07 x
    # Only the largest lease count is held to the target.
    assert [v for n, v in rows.items() if n.startswith("p99 gap")] == ["met"]


def test_report_renders_sections_that_ran_only() -> None:
    text = render(_results())
    assert "## Throughput" in text and "## Heartbeat precision" in text
    assert "## Footprint" not in text
    assert "| conductor-run | 1.10 |" in text


def test_the_cpu_per_task_target_comes_from_conductor_runs_rounds_only() -> None:
    results = _results()
    runs = results["throughput"]["runs"]
    for r, cpu in zip([r for r in runs if r["kind"] == "conductor-run"], [1.9, 2.4, 1.8], strict=False):
        r["worker_cpu_ms_per_task"] = cpu
    rows = {name: (measured, verdict) for name, measured, verdict in targets(results)}
    measured, verdict = rows["conductor-run CPU per task (runner + fork server) <= 2.0 ms"]
    assert verdict == "met" and measured.startswith("1.9")
    for r in runs:
        r["worker_cpu_ms_per_task"] = 2.5
    rows = {name: (measured, verdict) for name, measured, verdict in targets(results)}
    assert rows["conductor-run CPU per task (runner + fork server) <= 2.0 ms"] == ("2.50 ms", "**missed**")


def test_the_machines_steal_is_read_from_the_first_line_of_proc_stat() -> None:
    # Given /proc/stat's aggregate line: user nice system idle iowait irq softirq steal guest guest_nice
    text = "cpu  700 5 200 9000 40 0 15 40 30 0\ncpu0 350 2 100 4500 20 0 7 20 15 0\nintr 1\n"
    # Then steal is the 8th figure, and the total the first eight (guest is inside user already)
    assert machine_jiffies(text) == (40, 10000)
    assert machine_jiffies("intr 1 2 3\n") is None
    assert machine_jiffies("cpu  1 2 3 4\n") is None  # a kernel with no steal figure


def test_the_steal_share_is_the_steal_over_all_ticks_between_two_readings() -> None:
    assert steal_share((40, 10000), (240, 11000)) == pytest.approx(0.2)
    assert steal_share((40, 10000), (40, 10000)) is None  # no time passed
    assert steal_share(None, (40, 10000)) is None


def test_the_sampler_takes_busy_cores_and_steal_between_the_same_two_samples() -> None:
    sampler = CpuSampler(os.getpid(), os.getpid())  # not entered: no sampling thread
    # Given samples (monotonic, CPU seconds, (steal, total) ticks) at 0, 1 and 2 s
    sampler._samples = [(0.0, 0.0, (0, 100)), (1.0, 1.5, (10, 200)), (2.0, 3.5, (30, 300))]
    # Then a window from 0.5 to 2.0 runs from the sample at 0 to the one at 2
    assert sampler.cores_busy(0.5, 2.0) == pytest.approx(1.75)
    assert sampler.host_steal(0.5, 2.0) == pytest.approx(0.15)
    # And a window with no sample before it, or inside one interval, has no figure
    assert sampler.cores_busy(-1.0, 0.5) is None and sampler.host_steal(0.2, 0.5) is None


def test_the_throughput_table_gives_each_rounds_host_steal_where_it_was_measured() -> None:
    results = _results()
    runs = results["throughput"]["runs"]
    runs[0]["host_steal"] = 0.175
    runs[1]["host_steal"] = None
    section = render(results).split("## Throughput", 1)[1].split("\n## ", 1)[0]
    rows = {line.split(" | ")[0]: line for line in section.splitlines() if line.startswith("| ")}
    assert rows["| conductor-run"].endswith("| 17.5 (18) |")
    assert rows["| floor"].endswith("| n/a |")
    assert rows["| sdk"].endswith("| n/a |")  # a result written before steal was measured


def test_the_busy_section_renders_its_own_table_and_each_workers_time_over_its_quiet_time() -> None:
    results = _results()
    quiet = results["throughput"]
    assert isinstance(quiet, dict)
    busy = {**quiet, "runs": [{"kind": "conductor-run", "seconds": 2.2}, {"kind": "sdk", "seconds": 1.8}],
            "median_seconds": {"conductor-run": 2.2, "sdk": 1.8},
            "median_tasks_per_second": {"conductor-run": 4.5, "sdk": 5.6},
            "ratios": {**quiet["ratios"], "sdk_v1_over_conductor_run": None}}  # fmt: skip
    results["throughput_busy"] = busy
    text = render(results)
    section = text.split("## Throughput beside a busy process", 1)[1].split("\n## ", 1)[0]
    assert "| conductor-run | 2.20 |" in section and "| sdk | 1.80 |" in section
    assert "| floor |" not in section  # it did not run beside the busy process
    assert "SDK without update-v2" not in section  # nor did sdk-v1: no "n/a" line for it
    assert "(medians): conductor-run 2.00, sdk 1.20." in section
    assert text.index("## Throughput\n") < text.index("## Throughput beside")  # the quiet one first
    assert "beside" not in render(_results())  # no such section when it did not run


def test_floor_v2_gets_its_diagnostic_line_only_when_it_ran() -> None:
    assert "floor-v2 is the floor" not in render(_results())  # (the targets name floor-v2 always)
    results = _results()
    quiet = results["throughput"]
    assert isinstance(quiet, dict)
    quiet["ratios"] = {**quiet["ratios"], "floor_v2_over_floor": 0.92, "conductor_run_over_floor_v2": 1.2,
                       "sdk_over_floor_v2": 1.1}  # fmt: skip
    section = render(results).split("## Throughput", 1)[1].split("\n## ", 1)[0]
    line = next(x for x in section.splitlines() if x.startswith("Diagnostic (no target): floor-v2"))
    assert "floor-v2 / floor (time; the target asks 0.9 of conductor-run): 0.92" in line
    assert "conductor-run / floor-v2 (time): 1.20" in line
    assert "(time, = floor-v2's throughput over the SDK's; the target asks 1.25 of conductor-run): 1.10." \
        in line
    # A run without the floor: the ratios it has are still shown, the others left out.
    quiet["ratios"] = {**quiet["ratios"], "floor_v2_over_floor": None}
    section = render(results).split("## Throughput", 1)[1].split("\n## ", 1)[0]
    assert "floor-v2 / floor" not in section and "conductor-run / floor-v2 (time): 1.20" in section
