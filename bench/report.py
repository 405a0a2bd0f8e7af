"""The Markdown report, written from the JSON results alone (pure: no measuring, no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.stats import median, ratio


def _f(value: Any, digits: int = 3, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows for the issue's targets, from whatever sections ran."""
    rows: list[tuple[str, str, str]] = []
    tp = results.get("throughput")
    # The throughput targets against floor-v2 (the bare update-v2 chaining loop) and the SDK: from the
    # price section when it ran (every kind in the same alternating rounds), else the throughput one.
    src = results.get("price") or tp
    if src:
        meds = src["median_seconds"]
        cf = ratio(meds.get("conductor-run"), meds.get("floor-v2"))
        rows.append(
            (
                "conductor-run time <= 1.35 x floor-v2's (a group per tree)",
                f"{_f(cf, 2)} x",
                _verdict(None if cf is None else cf <= 1.35),
            )
        )
        off = meds.get("conductor-run-without-group")
        sc = ratio(meds.get("sdk"), off)
        rows.append(
            (
                "conductor-run --cgroup off throughput >= 1.0 x SDK's (both on update-v2)",
                f"{_f(sc, 2)} x" if off is not None else "not run (no conductor-run-without-group)",
                _verdict(None if sc is None else sc >= 1.0),
            )
        )
    hb = results.get("heartbeat")
    if hb:
        big = [r for r in hb["runs"] if r["kind"] == "conductor-run"]
        top = max((r["leases"] for r in big), default=None)
        for r in big:
            if r["leases"] != top:
                continue
            p99 = r["gaps_seconds"]["p99"]
            ok = p99 is not None and p99 <= r["target_p99_seconds"] and r["lost"] == 0
            rows.append(
                (
                    f"p99 gap <= 0.8 R + 50 ms, none lost ({r['leases']} leases, R = {r['r_seconds']} s)",
                    f"p99 {_f(p99)} s (target {_f(r['target_p99_seconds'])}), lost {r['lost']}",
                    _verdict(ok),
                )
            )
    for r in (results.get("stall") or {}).get("runner_stalled", []):
        lead = r["before_deadline_seconds"]
        rows.append(
            (
                f"tree gone before the lease deadline, runner stalled ({r['trees']} trees, load "
                f"{r['load_1min']}, fork server nice {r['forkserver_nice']})",
                f"{_f(lead)} s before it (worst tree)",
                _verdict(None if lead is None else lead > r["target_seconds"]),
            )
        )
    kl = results.get("kill")
    if kl:
        for r in kl["lease_deadline"]:
            if "before_deadline_seconds" not in r:  # an older run: gone after the deadline, by design
                continue
            lead = r["before_deadline_seconds"]
            rows.append(
                (
                    f"tree gone before the lease deadline ({r['mode']}, {r['trees']} trees)",
                    f"{_f(lead)} s before it (worst tree)",
                    _verdict(None if lead is None else lead > r["target_seconds"]),
                )
            )
        for r in kl["shutdown"]:
            lat, target = r["trees_gone_seconds"], r.get("target_seconds", kl["kill_grace_seconds"] + 0.2)
            rows.append(
                (
                    f"SIGTERM -> {r['tasks']} trees gone <= kill_grace + 200 ms ({r['mode']})",
                    f"{_f(lat)} s (target {_f(target)})",
                    _verdict(None if lat is None else lat <= target),
                )
            )
    for r in (results.get("kill-groups") or {}).get("runs", []):
        lat, target = r["trees_gone_seconds"], r["target_seconds"]
        rows.append(
            (
                f"SIGTERM -> {r['tasks']} trees gone <= kill_grace + 200 ms ({r['mode']}, "
                f"--cgroup {r['cgroup']})",
                f"{_f(lat)} s (target {_f(target)})",
                _verdict(None if lat is None else lat <= target),
            )
        )
    if src:  # runner + fork server CPU per task (start-up included), the median over the rounds
        cpu = median([r["worker_cpu_ms_per_task"] for r in src["runs"]
                      if r["kind"] == "conductor-run" and r.get("worker_cpu_ms_per_task") is not None])
        if cpu is not None:
            rows.append(("conductor-run CPU per task (runner + fork server) <= 2.0 ms",
                         f"{_f(cpu, 2)} ms", _verdict(cpu <= 2.0)))
    fp = results.get("footprint")
    if fp:
        for r in fp["idle"]:
            if r["kind"] != "conductor-run":
                continue
            rows.append(("idle CPU < 1 %", f"{_f(r['cpu_percent'], 2)} %", _verdict(r["cpu_percent"] < 1.0)))
            rows.append(
                ("idle RSS <= 40 MB (runner + fork server)", f"{_f(r['rss_max_mb'], 1)} MB",
                 _verdict(r["rss_max_mb"] <= 40.0))
            )
    return rows


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    out = [
        "# conductor-run benchmark report",
        "",
        f"Run {results['started_at']} ({_f(results['wall_seconds'], 0)} s), "
        f"command: `{results['command_line']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m['physical_cores']} physical), "
        f"{_f(m['memory_gb'], 1)} GB, {m['os']}; load average at start {m['load_average_at_start']}. "
        f"Python {m['python']}; conductor-run {results['versions']['conductor-run']}, "
        f"conductor-python {results['versions']['conductor-python']}, "
        f"psutil {results['versions']['psutil']}."
        + (f" conductor-run's bytecode: {results['bytecode']}." if results.get("bytecode") else ""),
        "",
        *(["Load average (1, 5, 15 min) as each section began and ended: " + "; ".join(
            f"{name} {v['start']} -> {v['end']}" for name, v in results["load_by_section"].items()) + ".", ""]
          if results.get("load_by_section") else []),
        "Every worker runs as a separate process against the embedded server, itself in its own process. "
        "Figures are what was measured on this (shared) machine in this run; see bench/README.md for "
        "exactly what each number counts.",
        "",
        "## Targets",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    out += [f"| {a} | {b} | {c} |" for a, b, c in targets(results)]
    if results.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    out += _throughput(results.get("throughput"))
    out += _throughput_busy(results.get("throughput_busy"), results.get("throughput"))
    out += _price(results.get("price"))
    out += _heartbeat(results.get("heartbeat"))
    out += _kill(results.get("kill"), results.get("stall")) + _kill_groups(results.get("kill-groups"))
    out += _footprint(results.get("footprint"))
    out += _heartbeat_real(results.get("heartbeat_real")) + _serverload(results.get("serverload"))
    out += _scale(results.get("scale"))
    if results.get("errors"):
        out += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    return "\n".join(out) + "\n"


def _throughput_busy(busy: dict[str, Any] | None, quiet: dict[str, Any] | None) -> list[str]:
    """The throughput table again, with a busy process beside (bench/neighbour.py), and each worker's
    time there over its time without it (the quiet section of the same run)."""
    if not busy:
        return []
    out = _throughput(busy, title="Throughput beside a busy process", lead=(
        "The same runs with one busy process beside the workers (a Python loop that never sleeps, in "
        "its own session, for the whole section): a host that also runs something else. No target; "
        "the ratios below say how much of each worker's throughput is left. "))
    if quiet:
        ratios = [
            f"{kind} {_f(ratio(busy['median_seconds'].get(kind), seconds), 2)}"
            for kind, seconds in quiet["median_seconds"].items() if kind in busy["median_seconds"]
        ]
        out += ["", "Time beside the busy process / time without it (medians): " + ", ".join(ratios) + "."]
    return out


def _throughput(tp: dict[str, Any] | None, *, title: str = "Throughput", lead: str = "") -> list[str]:
    if not tp:
        return []
    out = [
        "",
        f"## {title}",
        "",
        f"{lead}{tp['tasks']} tasks running `true` at concurrency {tp['concurrency']}, {tp['rounds']} "
        "alternating rounds; time = first claim to last final update, on the server's clock. CPU columns are "
        "diagnostics (medians): the server process's CPU during the run, and the worker's own processes' "
        "CPU including their start-up, per task. Final updates via: the endpoint each task's result came "
        "through (v1 `POST /api/tasks`; v2 `update-v2`, which also hands out the next task). `sdk-v1` is "
        "the same SDK worker, with the server answering update-v2 with 404 for its task type (as one "
        "without the endpoint), so it falls back to v1 and polls for each task like the others. "
        "Commands' CPU: the `true` commands' own, as the worker's processes reaped them; cores busy: the "
        "server's, the worker's and the commands' CPU over the run's time, of the machine's cores: near "
        "their number, a run is bound by the CPU, not by waits. Host steal: the share of the machine's "
        "CPU time the hypervisor gave to others during each round (`/proc/stat`), median, then every "
        "round's; a round with more steal ran on a slower machine.",
        "",
        "| worker | median s | median tasks/s | every round (s) | final updates via | server CPU ms/task "
        "| worker CPU ms/task | commands' CPU ms/task | cores busy | host steal % (every round) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, med in tp["median_seconds"].items():
        mine = [r for r in tp["runs"] if r["kind"] == kind]
        rounds = ", ".join(_f(r["seconds"], 2) for r in mine)
        server = median([r["server_cpu_ms_per_task"] for r in mine if "server_cpu_ms_per_task" in r])
        worker = median([r["worker_cpu_ms_per_task"] for r in mine if "worker_cpu_ms_per_task" in r])
        commands = median([r["task_cpu_ms_per_task"] for r in mine if "task_cpu_ms_per_task" in r])
        busy = median([r["cores_busy"] for r in mine if r.get("cores_busy") is not None])
        steals = [r.get("host_steal") for r in mine]  # absent from results of runs before it was measured
        steal = median([x for x in steals if x is not None])
        steal_text = "n/a" if steal is None else (
            f"{_f(100 * steal, 1)} ({', '.join('-' if x is None else _f(100 * x, 0) for x in steals)})")
        via: dict[str, int] = {}
        for r in mine:
            for endpoint, n in r.get("updates_via", {}).items():
                via[endpoint] = via.get(endpoint, 0) + n
        via_text = ", ".join(f"{k} {v}" for k, v in sorted(via.items())) or "n/a"
        refused = sum(r.get("v2_refused", 0) for r in mine)
        if refused:
            via_text += f" (update-v2 answered 404: {refused})"
        out.append(
            f"| {kind} | {_f(med, 2)} | {_f(tp['median_tasks_per_second'][kind], 0)} | {rounds} | "
            f"{via_text} | {_f(server, 2)} | {_f(worker, 2)} | {_f(commands, 2)} | {_f(busy, 2)} | "
            f"{steal_text} |"
        )
    r = tp["ratios"]
    out += [
        "",
        f"conductor-run / floor (time): {_f(r['conductor_run_over_floor'], 2)}; "
        f"SDK / conductor-run (time, = conductor-run's throughput advantage): "
        f"{_f(r['sdk_over_conductor_run'], 2)}.",
    ]
    out += _cpu_yardsticks(tp)
    if r.get("sdk_v1_over_conductor_run") is not None:  # only when sdk-v1 ran (never beside the busy process)
        out += [
            "",
            "Diagnostic (no target): SDK without update-v2 / conductor-run (time): "
            f"{_f(r['sdk_v1_over_conductor_run'], 2)}.",
        ]
    if r.get("v1_over_v2_conductor_run") is not None:  # only when conductor-run-v1 ran
        out += [
            "",
            "Diagnostic (no target): conductor-run on v1 only (the server refuses update-v2) / "
            f"conductor-run chaining through update-v2 (time): {_f(r['v1_over_v2_conductor_run'], 2)}.",
        ]
    out += _floor_v2(r)
    if r.get("metrics_on_over_off") is not None:  # only when conductor-run-metrics ran
        rounds_text = ", ".join(_f(x, 3) for x in r.get("metrics_on_over_off_per_round") or [])
        out += [
            "",
            f"Metrics on / off (time; target <= 1.03): {_f(r['metrics_on_over_off'], 3)} "
            f"(per round: {rounds_text}).",
        ]
    out += _metrics_ab(tp.get("metrics_ab"))
    return out


def _floor_v2(r: dict[str, Any]) -> list[str]:
    """The floor chaining through update-v2, against the targets' yardsticks (only when it ran)."""
    parts = [
        ("floor-v2 / floor (time; the target asks 0.9 of conductor-run)", r.get("floor_v2_over_floor")),
        ("conductor-run / floor-v2 (time)", r.get("conductor_run_over_floor_v2")),
        ("SDK / floor-v2 (time, = floor-v2's throughput over the SDK's; the target asks 1.25 of "
         "conductor-run)", r.get("sdk_over_floor_v2")),
    ]
    shown = [f"{what}: {_f(value, 2)}" for what, value in parts if value is not None]
    if not shown:
        return []
    return ["", "Diagnostic (no target): floor-v2 is the floor reporting with update-v2 and running the task "
            "each report claims (bench/floor.py --update-v2), one thread doing nothing else: what the "
            "chaining alone gives. " + "; ".join(shown) + "."]


def _metrics_ab(ab: dict[str, Any] | None) -> list[str]:
    """Metrics on / off, time and the worker's CPU (bench.metrics_ab)."""
    if not ab:
        return []
    out = ["", "Metrics on / off (bench/metrics_ab.py), ratio of the medians and the median of the "
           "per-round ratios:", "",
           "| measure | on / off (medians) | median per round | every round |", "|---|---|---|---|"]
    for name, what in (("time", "time (first claim to last update)"),
                       ("cpu", "worker CPU per task, start-up included"),
                       ("run_cpu", "worker CPU per task after \"serving\" (the run alone)")):
        rounds = ", ".join(_f(x, 3) for x in ab.get(f"{name}_on_over_off_per_round") or [])
        out.append(f"| {what} | {_f(ab.get(f'{name}_on_over_off'), 3)} | "
                   f"{_f(ab.get(f'{name}_per_round_median'), 3)} | {rounds} |")
    starts = ab.get("start_cpu_ms") or {}
    on, off = starts.get("conductor-run-metrics"), starts.get("conductor-run")
    out += ["", f"Start-up CPU (until \"serving\"), medians: metrics on {_f(on, 0)} ms, off {_f(off, 0)} ms."]
    return out


def _heartbeat(hb: dict[str, Any] | None) -> list[str]:
    if not hb:
        return []
    out = [
        "",
        "## Heartbeat precision",
        "",
        f"Children live {hb['hold_factor']} x R; a gap = time between consecutive lease confirmations "
        "(claim, then each accepted extendLease) of one task, as the server saw them. Lost = TIMED_OUT "
        "by the server while the child was still running.",
        "",
    ]
    out += _gap_table(hb["runs"], ("target p99 (s)", "lost"),
                      lambda r: (_f(r["target_p99_seconds"]), r["lost"]))
    for r in hb["runs"]:
        for reason, count in (r.get("failed_by_reason") or {}).items():
            out += ["", f"{r['kind']} L={r['leases']} R={r['r_seconds']} s: {count} FAILED, reason: "
                    f"`{reason[:300]}` (each one's reason and the worker's lines about it: the JSON's "
                    "`failed_tasks`)."]
    return out


def _heartbeat_real(hb: dict[str, Any] | None) -> list[str]:
    if not hb:
        return []
    out = [
        "",
        "## Heartbeat precision on the real server",
        "",
        f"The same measure on {hb['server']} (children live {hb['hold_factor']} x R). The gaps are "
        "between the answers a recording relay in front of the server saw (claim, then each accepted "
        "extendLease); over R = gaps a prompt timeout check (the embedded server's) would take back. "
        "Statuses are the real server's own, read after a decide of every workflow: its timeout checks "
        "run late (SQLite sweeper), so a lapse can go unpunished there.",
        "",
    ]
    return out + _gap_table(hb["runs"], ("over R", "TIMED_OUT"), lambda r: (r["gaps_over_r"], r["lost"]))


def _gap_table(
    runs: list[dict[str, Any]], last: tuple[str, str], cells: Callable[[dict[str, Any]], tuple[Any, Any]]
) -> list[str]:
    """The heartbeat tables' rows, on either server: the gaps, then two columns of their own."""
    out = [
        "| worker | leases | R (s) | gaps | p50 (s) | p99 (s) | max (s) "
        f"| {last[0]} | {last[1]} | statuses |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        g = r["gaps_seconds"]
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))
        first, second = cells(r)
        out.append(
            f"| {r['kind']} | {r['leases']} | {r['r_seconds']} | {g['count']} | {_f(g['p50'])} | "
            f"{_f(g['p99'])} | {_f(g['max'])} | {first} | {second} | {statuses} |"
        )
    return out


def _kill(kl: dict[str, Any] | None, st: dict[str, Any] | None = None) -> list[str]:
    if not kl and not st:
        return []
    head = kl or st or {}
    out = [
        "",
        "## Kill and shutdown latency (conductor-run)",
        "",
        f"Task tree: shell + grandchild + setsid escapee. R = heartbeat timeout = "
        f"{head['heartbeat_timeout_seconds']} s, kill_grace = {head['kill_grace_seconds']} s.",
        "",
        "| measure | tree | latency (s) |",
        "|---|---|---|",
    ]
    out += _stall_rows(st)
    if not kl:
        return out
    for r in kl["lease_deadline"]:
        if "before_deadline_seconds" in r:
            out.append(
                f"| tree gone before the server's lease deadline (server silenced; {r['trees']} trees: "
                f"worst, median) | {r['mode']} | {_f(r['before_deadline_seconds'])}, "
                f"{_f(r['before_deadline_median_seconds'])} |"
            )
        else:
            out.append(f"| lease deadline (server silenced) -> tree gone | {r['mode']} | "
                       f"{_f(r['latency_seconds'])} |")
    for r in kl["termination"]:
        out.append(f"| workflow terminated -> tree gone | {r['mode']} | {_f(r['latency_seconds'])} |")
    for r in kl["shutdown"]:
        out.append(f"| SIGTERM -> {r['tasks']} trees gone | {r['mode']} | {_f(r['trees_gone_seconds'])} |")
        out.append(
            f"| SIGTERM -> runner exited ({r['reported_failed']}/{r['tasks']} reported FAILED) | "
            f"{r['mode']} | {_f(r['exit_seconds'])} |"
        )
    return out


def _stall_rows(st: dict[str, Any] | None) -> list[str]:
    """The stalled-runner rows (bench/stall.py): the fork server's dead-man's switch alone."""
    out = []
    for r in (st or {}).get("runner_stalled", []):
        out.append(
            f"| tree gone before the server's lease deadline (runner stalled: SIGSTOP; "
            f"{r.get('measured_trees', r['trees'])} of {r['trees']} trees, the switch acting "
            f"{r.get('switch_late_max_ms')} ms late at most, "
            f"{r['busy']} CPU spinners, load {r['load_1min']}, {r.get('runnable')} runnable, fork server "
            f"nice {r['forkserver_nice']}: "
            f"worst, median) | {r['mode']} | {_f(r['before_deadline_seconds'])}, "
            f"{_f(r['before_deadline_median_seconds'])} |"
        )
    for r in (st or {}).get("thawed", []):
        if r.get("trees_frozen", True):
            what = (f"frozen host thawed (runner, fork server and trees SIGSTOPped {r['frozen_seconds']} s, "
                    f"trees thawed first; {r['trees']} trees): ran after the thaw")
        else:
            what = (f"runner and fork server SIGSTOPped {r['frozen_seconds']} s, trees running on "
                    f"({r['trees']} trees): ran after the fork server's SIGCONT")
        out.append(f"| {what}, worst, median | {r['mode']} | {_f(r['ran_after_thaw_max_seconds'])}, "
                   f"{_f(r['ran_after_thaw_median_seconds'])} |")
    return out


def _kill_groups(kg: dict[str, Any] | None) -> list[str]:
    if not kg:
        return []
    grace = kg["kill_grace_seconds"]
    out = [
        "",
        f"## Tree kill with a cgroup per tree vs without ({kg['tasks']} trees)",
        "",
        f"SIGTERM to the runner with {kg['tasks']} trees running (shell + grandchild + setsid escapee), "
        f"kill_grace = {grace} s. `auto`: a cgroup per tree; `off`: /proc tracking only. With "
        "`ignore-term` the trees live until the KILL, so gone - kill_grace is the KILL's own latency.",
        "",
        "| --cgroup | tree | trees gone (s) | gone - kill_grace (s) | runner exited (s) | reported FAILED "
        "| mechanism |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in kg["runs"]:
        gone = r["trees_gone_seconds"]
        kill = None if gone is None or r["mode"] != "ignore-term" else gone - grace
        mechanism = (r["mechanism"] or "?").split(" (limits")[0].split(";")[0]  # the full line: the JSON
        out.append(f"| {r['cgroup']} | {r['mode']} | {_f(gone)} | {_f(kill)} | {_f(r['exit_seconds'])} | "
                   f"{r['reported_failed']}/{r['tasks']} | {mechanism} |")  # fmt: skip
    return out


def _footprint(fp: dict[str, Any] | None) -> list[str]:
    if not fp:
        return []
    out = [
        "",
        "## Footprint",
        "",
        f"Idle: {fp['idle_seconds']:.0f} s of long polling an empty queue. CPU in % of one core; RSS summed "
        "over the worker's own (Python) processes, task children excluded.",
        "",
        "| worker | processes | idle CPU % | idle RSS max (MB) | RSS per process at the end (MB) |",
        "|---|---|---|---|---|",
    ]
    for r in fp["idle"]:
        each = ", ".join(f"{name} {_f(mb, 1)}" for name, mb in r.get("rss_by_process_mb", []))
        out.append(
            f"| {r['kind']} | {r['processes']} | {_f(r['cpu_percent'], 2)} | {_f(r['rss_max_mb'], 1)} "
            f"| {each or '-'} |"
        )
    out += [
        "",
        f"A child printing {fp['print_mb']} MB of 64-byte lines:",
        "",
        "| worker | peak RSS (MB) | seconds | task status |",
        "|---|---|---|---|",
    ]
    for r in fp["printing"]:
        out.append(f"| {r['kind']} | {_f(r['rss_peak_mb'], 1)} | {_f(r['seconds'], 1)} | {r['status']} |")
    return out


def _serverload(sl: dict[str, Any] | None) -> list[str]:
    if not sl:
        return []
    out = [
        "",
        "## Server load",
        "",
        f"Requests per running task per hour, by kind, counted at the server (R = {sl['r_seconds']} s; every "
        "task's child outlives the window, all slots busy). Window: "
        f"{_f(sl['runs'][0]['window_seconds'] if sl['runs'] else sl['window_seconds'], 0)} s, from "
        f"{sl['warmup_seconds']:.0f} s after every task was claimed; the rows ran at the same time, each on "
        "its own task type. Heartbeats also from the median gap between a task's accepted extendLease calls "
        "(3600 / gap), which the window's edges do not skew. Checks = GET /api/tasks/{id} (ownership); "
        "conductor-run's are bounded per runner by `ownership_check_rate` (20/s by default), shared by "
        "its tasks.",
        "",
        "| worker | tasks | polls | heartbeats (window) | heartbeats (from gaps) | checks | logs | other "
        "updates | all | worker's requests/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sl["runs"]:
        h = r["per_task_per_hour"]
        cells = [r["kind"], r["tasks"], _f(h["poll"], 0), _f(h["heartbeat"], 0),
                 _f(r["heartbeats_per_task_per_hour_from_gaps"], 0), _f(h["check"], 0), _f(h["log"], 0),
                 _f(h["update"], 0), _f(r["total_per_hour"], 0), _f(r["runner_requests_per_second"], 2)]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def _cpu_yardsticks(tp: dict[str, Any]) -> list[str]:
    """conductor-run's worker CPU against yardsticks measured in the same run: the machine's speed
    drifts by a third between runs (a `true` took 0.97 to 1.36 ms), which moves an absolute target's
    verdict without any change of code."""

    def cpu(kind: str, key: str) -> float | None:
        return median([r[key] for r in tp["runs"] if r["kind"] == kind and r.get(key) is not None])

    mine = cpu("conductor-run", "worker_cpu_ms_per_task")
    floor = cpu("floor", "worker_cpu_ms_per_task")
    command = cpu("conductor-run", "task_cpu_ms_per_task")
    if mine is None or (floor is None and command is None):
        return []
    parts = []
    if floor:
        parts.append(f"over the floor's {_f(mine / floor, 2)} "
                     "(when the throughput targets were set: 3.14 / 1.76 = 1.78; "
                     "its 2.0 ms target was 1.14 x that floor)")
    if command:
        parts.append(f"over the `true` commands' own {_f(mine / command, 2)}")
    return ["", "Diagnostic (no target): conductor-run's worker CPU per task " + "; ".join(parts) + "."]


def _price(tp: dict[str, Any] | None) -> list[str]:
    """The price list of safety (bench/price.py): each guarantee's cost per task, side by side."""
    if not tp or not tp.get("price"):
        return []
    pr = tp["price"]
    out = _throughput(tp, title="The price list of safety: the runs", lead=(
        "conductor-run as shipped, without one guarantee each (`--cgroup off`, or the bench-only build "
        "`bench/price_cli.py`), without all of them (`conductor-run-bare`), with its metrics on, floor-v2 "
        "and the SDK, in the same alternating rounds. "))
    c = pr["concurrency"]
    out += [
        "",
        "## The price list of safety",
        "",
        f"Per task, each part's price = the full run minus the run without it, within each round, median "
        f"over the rounds (metrics: on minus off, they are off by default). Wall = the run's time / "
        f"{pr['tasks']} tasks; slot = wall x {c} (the concurrency): how much longer each task keeps its "
        f"slot busy, which is the figure for a task of a given length; CPU = runner + fork server. "
        f"Share = of the full run's figure (wall {_f(pr['full_wall_ms_per_task'], 3)} ms, slot "
        f"{_f(pr['full_slot_ms_per_task'], 2)} ms, CPU {_f(pr['full_cpu_ms_per_task'], 2)} ms per task). "
        "Single prices are small differences of noisy runs: read the per-round figures before a digit.",
        "",
        "| guarantee | what it is | wall ms/task | slot ms/task | share of wall | CPU ms/task | share of CPU "
        "| wall ms/task, every round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in pr["parts"]:
        rounds = ", ".join(_f(x, 3) for x in r["wall_per_round"])
        share_w = "n/a" if r["share_of_wall"] is None else f"{100 * r['share_of_wall']:.0f} %"
        share_c = "n/a" if r["share_of_cpu"] is None else f"{100 * r['share_of_cpu']:.0f} %"
        out.append(f"| {r['part']} | {r['what']} | {_f(r['wall_ms_per_task'], 3)} | "
                   f"{_f(r['slot_ms_per_task'], 2)} | {share_w} | {_f(r['cpu_ms_per_task'], 2)} | "
                   f"{share_c} | {rounds} |")
    out += [
        "",
        f"Sum of the single parts (wall, metrics left out): {_f(pr['sum_of_parts_wall_ms'], 3)} ms per task; "
        "taking one part out lets the others' waits move, so the parts need not add up to the whole. "
        f"Not removable here: the fork server hop (the runner asks another process to spawn): the fork "
        f"server's own CPU is {_f(pr['forkserver_cpu_ms_per_task'], 2)} ms per task, an upper bound "
        "(its spawn and reaping would be paid in any spawner); output capture's pipes (kept in every run: "
        "the result's tails come from them). conductor-run over floor-v2 (wall, paired): "
        f"{_f(pr['gap_to_floor_v2_wall_ms_per_task'], 3)} ms per task.",
        "",
        f"**For a task that runs 100 ms, all of conductor-run's safety costs "
        f"{_f(pr['percent_of_100ms_task'], 1)} %** of its slot's time "
        f"({_f(pr['percent_of_100ms_task'], 2)} ms more per task at concurrency {c}; in CPU "
        f"{_f(pr['cpu_percent_of_100ms_task'], 2)} ms per task, "
        f"{_f(pr['cpu_percent_of_100ms_task'], 1)} % of one core over those 100 ms). Measured with `true` on "
        "this machine; the price per task does not "
        "grow with the task's length (a longer one adds its heartbeats, every 0.57-0.66 R, and its ownership "
        "checks, every 5 s or tasks / 20 s).",
    ]
    return out


def _scale(sc: dict[str, Any] | None) -> list[str]:
    """Many leases on one runner (bench/scale.py)."""
    if not sc:
        return []
    out = [
        "",
        "## Scale: many leases on one runner",
        "",
        f"One conductor-run holding L leases at once (spread over task types of at most 1000, the "
        f"concurrency key's bound, in one config file), R = {sc['r_seconds']} s, every child a "
        f"`sleep {sc['hold_seconds']:g}` (two heartbeats or more each); counts run one after the other, "
        f"within a budget of {sc['budget_seconds']:.0f} s. Gaps as in the heartbeat section; lost = "
        "TIMED_OUT by the server while its child ran. RSS: runner + fork server, max over the run (sampled "
        "every second). Window: from 2 s after the last claim until 5 s before the first child ends: every "
        "lease "
        "held, none ending; CPU of the runner and the fork server in it, and the runner's requests the "
        "server counted in it, per task and hour.",
        "",
        "| leases | claims spread (s) | gaps | p50 (s) | p99 (s) | max (s) | target p99 (s) | lost | RSS MB "
        "(runner, fork server) | RSS KB/lease | open fds (runner, fork server) | window (s) | "
        "CPU ms/lease/min | cores busy | requests/task-hour (heartbeat, check, poll, other) | requests/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sc["runs"]:
        g, w = r["gaps_seconds"], r.get("window") or {}
        rss, fds = r["rss_max_mb"], r.get("open_fds_max") or {}
        per = w.get("requests_per_task_per_hour") or {}
        req = ", ".join(_f(per.get(k), 0) for k in ("heartbeat", "check", "poll", "update")) if per else "n/a"
        out.append(
            f"| {r['leases']} | {_f(r['claim_spread_seconds'], 1)} | {g['count']} | {_f(g['p50'])} | "
            f"{_f(g['p99'])} | {_f(g['max'])} | {_f(r['target_p99_seconds'], 2)} | {r['lost']} | "
            f"{_f(r['rss_max_total_mb'], 0)} ({_f(rss.get('runner'), 0)}, {_f(rss.get('forkserver'), 0)}) | "
            f"{_f(r['rss_kb_per_lease'], 1)} | {fds.get('runner', 'n/a')}, {fds.get('forkserver', 'n/a')} | "
            f"{_f(w.get('seconds'), 0)} | "
            f"{_f(w.get('cpu_ms_per_lease_per_minute'), 2)} | {_f(w.get('cores_busy'), 3)} | {req} | "
            f"{_f(w.get('requests_per_second'), 1)} |"
        )
    for r in sc["runs"]:
        if r.get("held_cap") is not None:
            statuses = ", ".join(f"{k} {v}" for k, v in r["statuses"].items())
            out += ["", f"{r['leases']} leases: the runner's open-file limit held {r['held_cap']} trees at "
                    f"once (it said so at start and claimed no more); the other "
                    f"{r['leases'] - r['held_cap']} were claimed as slots freed; statuses {statuses}."]
    for s in sc.get("slopes", []):
        out.append("")
        out.append(f"From {s['from']} to {s['to']} leases: {_f(s['rss_kb_per_added_lease'], 1)} KB of RSS "
                   "per added lease.")
    for f in sc.get("failed", []):
        out += ["", f"{f['leases']} leases: the run failed: `{f['error'].splitlines()[0][:300]}`"]
    if sc.get("skipped"):
        out += ["", f"Not run (would not fit in the budget): {', '.join(map(str, sc['skipped']))} leases."]
    return out
