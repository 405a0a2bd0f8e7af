"""The reporter's thread pool (``SenderPool``): what it kept of ThreadPoolExecutor's behaviour.

Its bound (a thread only when none is idle, at most N), its close (every job handed over runs, then
the threads are joined; no job after), at interpreter exit (the jobs handed over still run, and the
interpreter does not hang on idle threads), a pool dropped without close, and a job that raises.
Real threads and a real child interpreter; every wait is on a condition with a deadline.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from leasecore.runner.upstream.senderpool import SenderPool
from tests.support import wait_until

WAIT = 10.0


def _pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}_")]


def test_close_runs_every_job_handed_over_then_joins_the_threads() -> None:
    pool = SenderPool(3, "sp-close")
    gate = threading.Event()
    done: list[int] = []

    def job(n: int) -> None:
        gate.wait(WAIT)
        done.append(n)

    for n in range(20):  # most wait behind the gate, queued
        pool.submit(job, n)
    assert len(_pool_threads("sp-close")) <= 3
    closer = threading.Thread(target=pool.close)
    closer.start()
    gate.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert sorted(done) == list(range(20))
    assert _pool_threads("sp-close") == []  # joined, not left behind
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(done.append, 99)
    pool.close()  # idempotent
    assert 99 not in done


def test_a_thread_starts_only_when_none_is_idle_up_to_the_bound() -> None:
    pool = SenderPool(2, "sp-bound")
    try:
        for _ in range(5):  # one job at a time: the one thread, idle again, takes each
            finished = threading.Event()
            pool.submit(finished.set)
            assert finished.wait(WAIT)
            wait_until(lambda: pool._idle, WAIT, "the thread counted idle again")
        assert [t.name for t in _pool_threads("sp-bound")] == ["sp-bound_0"]

        gate = threading.Event()
        started: list[str] = []

        def held() -> None:
            started.append(threading.current_thread().name)
            gate.wait(WAIT)

        for _ in range(4):  # all held: a second thread, never a third; the rest wait their turn
            pool.submit(held)
        wait_until(lambda: len(started) == 2, WAIT, "two held jobs running")
        assert sorted(t.name for t in _pool_threads("sp-bound")) == ["sp-bound_0", "sp-bound_1"]
        assert len(started) == 2  # the bound holds the other two back
        gate.set()
        wait_until(lambda: len(started) == 4, WAIT, "the queued jobs running once a thread was free")
        assert len(_pool_threads("sp-bound")) == 2
    finally:
        pool.close()


def test_jobs_run_in_the_order_they_came_on_one_thread() -> None:
    pool = SenderPool(1, "sp-order")
    seen: list[int] = []
    for n in range(50):
        pool.submit(seen.append, n)
    pool.close()
    assert seen == list(range(50))


def test_a_job_that_raises_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    pool = SenderPool(1, "sp-raise")
    after = threading.Event()

    def boom() -> None:
        raise ValueError("planted")

    with caplog.at_level(logging.ERROR, logger="conductor_run.report"):
        pool.submit(boom)
        pool.submit(after.set)
        assert after.wait(WAIT)
        pool.close()
    assert [t.name for t in _pool_threads("sp-raise")] == []
    assert any("sender pool" in r.getMessage() and r.exc_info and "planted" in str(r.exc_info[1])
               for r in caplog.records)


def test_a_pool_dropped_without_close_ends_its_threads() -> None:
    pool = SenderPool(2, "sp-dropped")
    finished = threading.Event()
    pool.submit(finished.set)
    assert finished.wait(WAIT)
    assert _pool_threads("sp-dropped")
    del pool
    gc.collect()
    wait_until(lambda: not _pool_threads("sp-dropped"), WAIT, "the dropped pool's threads to end")


def test_at_interpreter_exit_the_jobs_handed_over_still_run(tmp_path: Path) -> None:
    """No close: the interpreter neither drops the queued jobs nor hangs on the idle threads."""
    out = tmp_path / "out"
    script = f"""
import threading
from pathlib import Path
from leasecore.runner.upstream.senderpool import SenderPool
pool = SenderPool(2, "exit")
gate = threading.Event()
pool.submit(gate.wait, 30)          # holds one thread until the last job is queued
for n in range(30):
    pool.submit(lambda n=n: Path({str(out)!r}).open("a").write(f"{{n}}\\n"))
gate.set()
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                           timeout=60, capture_output=True, text=True)  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert sorted(int(line) for line in out.read_text().split()) == list(range(30))


def test_the_bound_must_be_a_thread_at_least() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        SenderPool(0, "sp-none")
