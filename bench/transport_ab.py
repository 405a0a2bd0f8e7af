"""Transport A/B: the client's CPU per call on each transport, against the bench server in its own process.

``python -m bench.transport_ab [--calls 3000] [--rounds 5] [--threads 1,4]``

The question: does urllib3 used directly (a well-kept library: TLS and proxies included, already
installed under requests) come within 5 % of the hand-written lean transport? If so it should replace
it. :class:`Urllib3Transport` is that prototype: a :class:`~leasecore.conductor.transport.Transport`
over one ``urllib3.HTTPConnectionPool`` (no retries, no redirects, the answer streamed against the
deadline and the size limit, the same framing refusals as the other two). It lives here, not in
leasecore, because it lost (docs/benchmarks.md, "The client's transport", has the figures).

What is measured: ``time.process_time()`` of this process (the server runs in another one, so its CPU
is not counted) over ``calls`` client calls of three shapes the runner makes (extendLease, GET task,
an empty poll with ``timeout_ms=0``), per transport, in rounds whose order rotates so that a busy
spell of the shared machine does not land on one transport only; medians over the rounds. CPU time
is far less sensitive to other load than wall time; wall time is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import urllib3

from bench.harness import BenchServer
from leasecore.conductor.client import MAX_BODY_BYTES, POOL_MAXSIZE, ConductorClient
from leasecore.conductor.lean import LeanTransport
from leasecore.conductor.transport import RequestsTransport, Transport
from leasecore.http_framing import BodyTooLarge, FramingError, body_length

KINDS = ("lean", "urllib3", "requests")
METRICS = ("cpu_us_per_call", "wall_us_per_call")


class Urllib3Transport:
    """A Transport on ``urllib3.HTTPConnectionPool`` directly (plain HTTP here; HTTPS: the same class)."""

    def __init__(self, base_url: str, *, pool_maxsize: int, max_body_bytes: int,
                 monotonic: Callable[[], float]) -> None:
        parts = urlsplit(base_url)
        self._pool = urllib3.HTTPConnectionPool(
            parts.hostname or "", parts.port or 80, maxsize=pool_maxsize, block=False, retries=False
        )
        self._max_body_bytes = max_body_bytes
        self._monotonic = monotonic

    @property
    def connections_opened(self) -> int | None:
        return self._pool.num_connections

    @property
    def generation(self) -> int:
        return 0

    def abort(self) -> None:
        """Not measured here: this prototype does not cut calls in flight (a forced stop's abort); a call
        waits for its own deadline (the client bounds calls after an abort to 1 s)."""

    def close(self) -> None:
        self._pool.close()

    def send(self, method: str, target: str, body: bytes | None, headers: Mapping[str, str],
             deadline: float, *, idempotent: bool, generation: int | None = None) -> tuple[int, bytes]:
        remaining = deadline - self._monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        response = self._pool.urlopen(
            method, target, body=body, headers=dict(headers), retries=False, redirect=False,
            timeout=urllib3.Timeout(total=remaining), preload_content=False, assert_same_host=False,
        )
        try:
            if method == "HEAD" or response.status in (204, 304):
                return response.status, b""
            coding, length = response.headers.get("Transfer-Encoding"), response.headers.get("Content-Length")
            body_length(() if coding is None else (coding,), () if length is None else (length,),
                        self._max_body_bytes, what="answer")
            chunks: list[bytes] = []
            size = 0
            for chunk in response.stream(64 * 1024):
                chunks.append(chunk)
                size += len(chunk)
                if size > self._max_body_bytes:
                    raise BodyTooLarge(self._max_body_bytes, "answer")
                if self._monotonic() > deadline:
                    raise TimeoutError("timed out reading the answer")
            return response.status, b"".join(chunks)
        except FramingError as exc:
            exc.answer_status = response.status
            raise
        finally:
            response.release_conn()


def make_transport(kind: str, url: str) -> Transport:
    common: dict[str, Any] = {"max_body_bytes": MAX_BODY_BYTES, "monotonic": time.monotonic}
    parts = urlsplit(url)
    if kind == "lean":
        return LeanTransport(parts.hostname or "", parts.port or 80, max_idle=POOL_MAXSIZE, **common)
    if kind == "urllib3":
        return Urllib3Transport(url, pool_maxsize=POOL_MAXSIZE, **common)
    return RequestsTransport(f"{parts.scheme}://{parts.netloc}", pool_maxsize=POOL_MAXSIZE, **common)


def one_round(
    url: str, kind: str, task_id: str, workflow_id: str, calls: int, threads: int
) -> dict[str, float]:
    client = ConductorClient(url, transport=make_transport(kind, url), timeout_seconds=10)
    shapes: list[Callable[[], object]] = [
        lambda: client.extend_lease(task_id, workflow_id, worker_id="bench"),
        lambda: client.get_task(task_id),
        lambda: client.poll("transport_ab_empty", count=1, timeout_ms=0),
    ]

    def work(share: int) -> None:
        for index in range(share):
            shapes[index % len(shapes)]()

    try:
        work(30)  # warm: connections open, code paths hot
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if threads == 1:
            work(calls)
        else:
            with ThreadPoolExecutor(threads) as pool:
                for future in [pool.submit(work, calls // threads) for _ in range(threads)]:
                    future.result()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        client.close()
    return {"cpu_us_per_call": 1e6 * cpu / calls, "wall_us_per_call": 1e6 * wall / calls}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,4", help="comma list of client thread counts")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp) / "server.log")
        try:
            task_type = "transport_ab"
            server.define(task_type)
            server.start(task_type, 1)
            # The task stays IN_PROGRESS (claimed, never finished): extendLease and GET on it work.
            (task,) = server.client.poll(task_type, count=1, timeout_ms=2000, worker_id="bench")
            results: dict[str, Any] = {}
            for threads in thread_counts:
                runs: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
                for round_no in range(args.rounds):
                    order = KINDS[round_no % len(KINDS):] + KINDS[: round_no % len(KINDS)]
                    for kind in order:
                        figures = one_round(
                            server.url, kind, task.task_id, task.workflow_id, args.calls, threads
                        )
                        runs[kind].append(figures)
                        print(f"threads={threads} round {round_no + 1}/{args.rounds} {kind:8}: "
                              f"{figures['cpu_us_per_call']:7.1f} us CPU/call, "
                              f"{figures['wall_us_per_call']:7.1f} us wall/call", flush=True)
                medians = {
                    kind: {m: statistics.median(r[m] for r in rs) for m in METRICS}
                    for kind, rs in runs.items()
                }
                results[f"threads={threads}"] = {"runs": runs, "medians": medians}
                lean = medians["lean"]["cpu_us_per_call"]
                for kind in KINDS:
                    cpu = medians[kind]["cpu_us_per_call"]
                    print(f"threads={threads} median {kind:8}: {cpu:7.1f} us CPU/call "
                          f"({100 * (cpu / lean - 1):+.0f} % vs lean), "
                          f"{medians[kind]['wall_us_per_call']:7.1f} us wall/call", flush=True)
        finally:
            server.close()
    if args.json:
        args.json.write_text(json.dumps({"calls": args.calls, "rounds": args.rounds, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
