"""Plumbing shared by every scenario: the server process, the workers, task supply, waits.

Each worker runs as its own process (in its own session, so the whole group can be cleaned up), against
the bench server process (:mod:`bench.server`). Nothing here measures; scenarios do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from leasecore.conductor.client import ConductorAdmin, ConductorClient

ROOT = Path(__file__).resolve().parent.parent
CHILDREN = Path(__file__).resolve().parent / "children"
WORKER_KINDS = ("conductor-run", "sdk", "floor", "sdk-v1", "floor-v2")
# The SDK as is, and the same SDK against a server that refuses update-v2 for its task type (so it
# reports with v1 and polls for every task, like the other two): a throughput diagnostic only.
SDK_KINDS = ("sdk", "sdk-v1")
# Kinds only the throughput section runs: the floor sends no heartbeats and is no product; sdk-v1 only
# explains the SDK's throughput figure.
# conductor-run with its metrics endpoint on (--metrics-port 0): the A/B of the metrics'
# promise "counting must not slow the hot paths"
# (python -m bench --only throughput --workers conductor-run,conductor-run-metrics).
METRICS_KIND = "conductor-run-metrics"
# conductor-run on the urllib3-direct transport prototype (bench.urllib3_cli): the transport A/B of
# the client's transport (does urllib3 used directly beat the lean one?), run only when asked for
# (--workers conductor-run,conductor-run-urllib3).
URLLIB3_KIND = "conductor-run-urllib3"
# conductor-run against a server that refuses update-v2 for its task type (404): its one refused call
# falls back to v1 for good, so it polls for every task; the A/B of update-v2's chaining (not by default:
# --workers conductor-run,conductor-run-v1).
V1_KIND = "conductor-run-v1"
# conductor-run from another checkout (python -m bench --base-checkout DIR): old against new in one
# run, rounds alternating (--workers conductor-run,conductor-run-base).
BASE_KIND = "conductor-run-base"
BASE_CHECKOUT: Path | None = None
BASE_CGROUP: str | None = None  # --base-cgroup MODE: conductor-run-base's --cgroup (e.g. auto against off)
# The floor chaining through update-v2 (bench.floor --update-v2): what the chaining alone is worth to a
# worker that does nothing else; the yardstick for how far the throughput targets can be reached.
FLOOR_V2_KIND = "floor-v2"
# The price list of safety (bench.price): conductor-run with one guarantee taken out each, through its
# own switch (--cgroup off) or a bench-only build (bench.price_cli: patches of this process only), and
# with all of them out at once ("bare"). Kind -> (parts bench.price_cli takes out, --cgroup off?).
PRICE_KINDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "conductor-run-without-group": ((), True),
    "conductor-run-without-files": (("files",), False),
    "conductor-run-without-logstream": (("logstream",), False),
    "conductor-run-without-lease": (("lease",), False),
    "conductor-run-without-record": (("record",), False),
    "conductor-run-bare": (("files", "logstream", "lease", "record"), True),
}
THROUGHPUT_ONLY_KINDS = ("floor", FLOOR_V2_KIND, "sdk-v1", METRICS_KIND, URLLIB3_KIND, BASE_KIND, V1_KIND,
                         *PRICE_KINDS)


def wait_until(
    predicate: Callable[[], bool],
    timeout_seconds: float,
    interval_seconds: float = 0.05,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` until true; raise TimeoutError naming ``what`` after ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_seconds:.0f} s waiting for {what}")
        time.sleep(interval_seconds)


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().startswith(("conductor_", "conductor."))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra or {})
    return env


class BenchServer:
    """The embedded server in its own process, with the recording control channel of bench.server."""

    def __init__(self, log_path: Path) -> None:
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env=_clean_env(),
            text=True,
            bufsize=1,
        )
        hello = json.loads(self._stdout.readline())
        self.url: str = hello["url"]
        self.pid: int = hello["pid"]
        self.client = ConductorClient(self.url, timeout_seconds=30.0)
        self.admin = ConductorAdmin(self.client)

    @property
    def _stdout(self) -> IO[str]:
        assert self.process.stdout is not None
        return self.process.stdout

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply: dict[str, Any] = json.loads(self._stdout.readline())
        return reply

    def marks(self, task_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """Claims, lease confirmations, updates and statuses recorded for ``task_ids``."""
        return self._ask({"cmd": "marks", "task_ids": None if task_ids is None else list(task_ids)})

    def _command(self, cmd: str, task_type: str) -> None:
        reply = self._ask({"cmd": cmd, "task_type": task_type})
        if not reply.get("ok"):
            raise RuntimeError(f"the bench server did not do {cmd} for {task_type}: {reply}")

    def refuse_update_v2(self, task_type: str) -> None:
        """Make the server answer update-v2 for ``task_type`` with 404, as one without the endpoint."""
        self._command("refuse_update_v2", task_type)

    def hold_polls(self, task_type: str) -> None:
        """Polls for ``task_type`` find nothing (tasks can be queued meanwhile) until released."""
        self._command("hold_polls", task_type)

    def release_polls(self, task_type: str) -> None:
        self._command("release_polls", task_type)

    def requests(self) -> dict[str, dict[str, int]]:
        """Worker calls the server counted so far: task type -> kind -> calls (see bench.server)."""
        counts = self._ask({"cmd": "requests"})
        return {t: {k: int(n) for k, n in kinds.items()} for t, kinds in counts.items()}

    def settled(self, task_ids: Sequence[str]) -> int:
        """How many of ``task_ids`` got their final update or ended on the server (e.g. timed out)."""
        return int(self._ask({"cmd": "progress", "task_ids": list(task_ids)})["settled"])

    def wait_settled(
        self,
        task_ids: Sequence[str],
        timeout_seconds: float,
        worker: WorkerProcess | None = None,
        interval_seconds: float = 0.25,
    ) -> None:
        """Wait until every task is settled; fail early if ``worker`` died."""

        def done() -> bool:
            if worker is not None and not worker.alive():
                raise RuntimeError(f"the {worker.cfg.kind} worker exited early:\n{worker.log_tail()}")
            return self.settled(task_ids) >= len(task_ids)

        wait_until(done, timeout_seconds, interval_seconds, what=f"{len(task_ids)} tasks to settle")

    def pause(self) -> None:
        """Silence the server: SIGSTOP (connections stay open, nothing answers)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self.client.close()
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stdout.close()
        self._log.close()

    # -------------------------------------------------------------------------------- task supply

    def define(self, task_type: str, *, response_timeout_seconds: int = 3600) -> None:
        """A task def (no retries: a timed-out task stays TIMED_OUT) and a one-task workflow for it."""
        self.admin.register_task_defs(
            [
                {
                    "name": task_type,
                    "retryCount": 0,
                    "retryDelaySeconds": 0,
                    "responseTimeoutSeconds": response_timeout_seconds,
                    "timeoutSeconds": 0,
                    "timeoutPolicy": "TIME_OUT_WF",
                    "ownerEmail": "bench@example.com",
                }
            ]
        )
        self.admin.register_workflow(
            {
                "name": f"wf_{task_type}",
                "version": 1,
                "schemaVersion": 2,
                "ownerEmail": "bench@example.com",
                "tasks": [{"name": task_type, "taskReferenceName": "t", "type": "SIMPLE"}],
            },
            overwrite=True,
        )

    def start(self, task_type: str, count: int, input_data: dict[str, Any] | None = None) -> list[str]:
        """Start ``count`` workflows of ``task_type``; return their ids."""
        return [self.admin.start_workflow(f"wf_{task_type}", input_data or {"i": i}) for i in range(count)]

    def task_ids(self, workflow_ids: Sequence[str]) -> list[str]:
        ids: list[str] = []
        for wf_id in workflow_ids:
            ids.extend(str(t["taskId"]) for t in self.admin.get_workflow(wf_id).get("tasks", []))
        return ids


# ------------------------------------------------------------------------------------ workers


@dataclass
class WorkerConfig:
    """What a worker process is asked to do."""

    kind: str  # one of WORKER_KINDS
    url: str
    task_type: str
    concurrency: int
    command: Sequence[str]
    state_dir: Path
    lease_extend: bool = True
    kill_grace_seconds: float | None = None
    heartbeat_timeout_seconds: float | None = None
    poll_timeout_ms: int | None = None
    cgroup: str | None = None  # conductor-run's --cgroup (auto | v2 | v1 | off); None: its default
    prefix: Sequence[str] = ()  # conductor-run: a command it runs under (e.g. setpriv dropping a capability)
    # conductor-run: a config file whose [[task]] tables say the task types, commands and concurrency
    # (task_type, concurrency and command above are then not passed): one runner, several task types
    config_file: Path | None = None


CONDUCTOR_RUN_CGROUP: str | None = None  # python -m bench --cgroup MODE: every conductor-run's default


def worker_argv(cfg: WorkerConfig) -> list[str]:
    """The command line that starts ``cfg.kind`` as a worker process."""
    py = [sys.executable]
    if cfg.kind in ("conductor-run", METRICS_KIND, URLLIB3_KIND, BASE_KIND, V1_KIND, *PRICE_KINDS):
        parts, no_group = PRICE_KINDS.get(cfg.kind, ((), False))
        if parts:
            entry = ["bench.price_cli", "--without", ",".join(parts)]
        else:
            entry = ["bench.urllib3_cli" if cfg.kind == URLLIB3_KIND else "cli"]
        argv = [
            *py,
            "-m",
            *entry,
            "run",
            "--server",
            cfg.url,
            *(["--config", str(cfg.config_file)] if cfg.config_file is not None else
              ["--task-type", cfg.task_type, "--concurrency", str(cfg.concurrency)]),
            "--worker-id",
            "bench-conductor-run",
            "--state-dir",
            str(cfg.state_dir),
            "--lease-extend" if cfg.lease_extend else "--no-lease-extend",
        ]
        if cfg.kill_grace_seconds is not None:
            argv += ["--kill-grace", str(cfg.kill_grace_seconds)]
        if cfg.heartbeat_timeout_seconds is not None:
            argv += ["--heartbeat-timeout", str(cfg.heartbeat_timeout_seconds)]
        if cfg.poll_timeout_ms is not None:
            argv += ["--poll-timeout", str(cfg.poll_timeout_ms)]
        if cfg.kind == METRICS_KIND:
            argv += ["--metrics-port", "0"]  # loopback, a free port (logged)
        cgroup = cfg.cgroup if cfg.cgroup is not None else CONDUCTOR_RUN_CGROUP
        if no_group:
            cgroup = "off"
        if cfg.kind == BASE_KIND and BASE_CGROUP is not None:
            cgroup = BASE_CGROUP
        if cgroup is not None:
            argv += ["--cgroup", cgroup]
        if cfg.config_file is not None:  # the config file's [[task]] tables name the commands
            return [*cfg.prefix, *argv]
        return [*cfg.prefix, *argv, "--", *cfg.command]
    if cfg.kind in SDK_KINDS:  # sdk-v1: the same worker; the server side differs
        return [
            *py,
            "-m",
            "bench.sdk_worker",
            "--server",
            cfg.url,
            "--task-type",
            cfg.task_type,
            "--threads",
            str(cfg.concurrency),
            "--lease-extend" if cfg.lease_extend else "--no-lease-extend",
            "--",
            *cfg.command,
        ]
    if cfg.kind in ("floor", FLOOR_V2_KIND):
        return [
            *py,
            "-m",
            "bench.floor",
            "--server",
            cfg.url,
            "--task-type",
            cfg.task_type,
            "--concurrency",
            str(cfg.concurrency),
            *(["--update-v2"] if cfg.kind == FLOOR_V2_KIND else []),
            "--",
            *cfg.command,
        ]
    raise ValueError(f"unknown worker kind {cfg.kind!r}")


def _checkout(kind: str) -> Path:
    """Where a worker's code comes from: this checkout, or --base-checkout's for BASE_KIND."""
    if kind != BASE_KIND:
        return ROOT
    if BASE_CHECKOUT is None:
        raise ValueError(f"worker kind {BASE_KIND} needs --base-checkout DIR")
    return BASE_CHECKOUT


class WorkerProcess:
    """One worker process in its own session; ``stop()`` asks it to stop the way its users would."""

    def __init__(self, cfg: WorkerConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.started_at = time.monotonic()
        self.stop_sent_at: float | None = None
        self.process = subprocess.Popen(
            worker_argv(cfg),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=_checkout(cfg.kind),
            env=_clean_env({"PYTHONPATH": str(_checkout(cfg.kind))}),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout_seconds: float = 30.0) -> float | None:
        """Ask it to stop (SDK: SIGINT, as Ctrl-C; others: SIGTERM); return seconds to exit, or None."""
        if not self.alive():
            self._cleanup()
            return None
        sent = self.stop_sent_at = time.monotonic()
        sig = signal.SIGINT if self.cfg.kind in SDK_KINDS else signal.SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        try:
            self.process.wait(timeout=timeout_seconds)
            took: float | None = time.monotonic() - sent
        except subprocess.TimeoutExpired:
            took = None
        self._cleanup()
        return took

    def _cleanup(self) -> None:
        # Whatever is left in the worker's session (SDK processes it orphaned, stray children) goes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self._log.close()


@contextlib.contextmanager
def running_worker(cfg: WorkerConfig, log_path: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(cfg, log_path)
    try:
        yield worker
    finally:
        worker.stop()
