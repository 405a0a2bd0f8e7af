"""Pure pieces of the runner: poll backoff, reachability lines, log batching, exit-code decision."""

from __future__ import annotations

import signal

import pytest

from cli import exitcodes
from cli.run import exit_code_for
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorRejected,
    ConductorUnavailable,
)
from leasecore.models import TaskStatus
from leasecore.runner.ports import RunOutcome
from leasecore.runner.upstream.logsink import LogBuffer, LogStreamer, WholeEntry
from leasecore.runner.upstream.poller import failure_kind
from leasecore.runner.upstream.pollpolicy import BackoffPolicy, PollBackoff, Reachability


def test_empty_polls_back_off_exponentially_up_to_the_cap() -> None:
    backoff = PollBackoff(BackoffPolicy(empty_base_seconds=0.1, empty_cap_seconds=1.0), rand=lambda: 0.0)
    delays = [backoff.on_empty() for _ in range(6)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_errors_back_off_to_their_own_cap_and_work_resets_everything() -> None:
    backoff = PollBackoff(BackoffPolicy(error_base_seconds=0.5, error_cap_seconds=10.0), rand=lambda: 0.0)
    delays = [backoff.on_error() for _ in range(8)]
    assert delays[0] == pytest.approx(0.5)
    assert max(delays) == pytest.approx(10.0)
    assert backoff.consecutive_errors == 8
    assert backoff.on_tasks() == 0.0
    assert backoff.consecutive_errors == 0
    assert backoff.on_error() == pytest.approx(0.5)


def test_error_backoff_never_reaches_zero_even_after_many_failures() -> None:
    # Given the worst jitter draw and a very long outage, the delay still stays well above 0:
    # a server that is down is never polled in a tight loop.
    backoff = PollBackoff(BackoffPolicy(jitter=0.5), rand=lambda: 1.0)
    delays = [backoff.on_error() for _ in range(10_000)]
    assert min(delays) >= 0.25
    assert max(delays) <= 10.0


def test_jitter_draws_from_the_lower_part_of_the_interval() -> None:
    low = PollBackoff(BackoffPolicy(jitter=0.5), rand=lambda: 1.0).on_empty()
    high = PollBackoff(BackoffPolicy(jitter=0.5), rand=lambda: 0.0).on_empty()
    assert (low, high) == pytest.approx((0.05, 0.1))


def test_reachability_logs_once_per_change_not_once_per_failure() -> None:
    state = Reachability()
    lines = []
    for outcome in ["fail", "fail", "fail", "ok", "ok", "fail"]:
        state, line = state.on_failure("connection refused") if outcome == "fail" else state.on_success()
        lines.append(line)
    assert lines == [
        "server unreachable: connection refused (will keep retrying)",
        None,
        None,
        "server reachable again",
        None,
        "server unreachable: connection refused (will keep retrying)",
    ]


def test_refused_credentials_are_logged_as_such_once_per_change_of_state() -> None:
    # Given a server that first refuses our credentials, then is down, then refuses them again:
    state = Reachability()
    lines = []
    for kind in ["auth", "auth", "unreachable", "unreachable", "auth", "auth", None]:
        if kind is None:
            state, line = state.on_success()
        else:
            state, line = state.on_failure("HTTP 401", kind)  # type: ignore[arg-type]
        lines.append(line)
    # Then one line per change, and a refusal never reads "unreachable".
    refused = ("the server refused our credentials: HTTP 401 (check CONDUCTOR_AUTH_KEY and "
               "CONDUCTOR_AUTH_SECRET; will keep retrying)")
    assert lines == [
        refused,
        None,
        "server unreachable: HTTP 401 (will keep retrying)",
        None,
        refused,
        None,
        "the server accepts our credentials again",
    ]
    assert state.reachable and state.kind is None


def _sent_without_credentials() -> ConductorAuthError:
    error = ConductorAuthError("HTTP 401 (the server wants credentials: set CONDUCTOR_AUTH_KEY/SECRET)")
    error.without_credentials = True
    return error


def test_a_server_that_wants_credentials_we_do_not_have_is_told_once_without_a_double_hint() -> None:
    error = _sent_without_credentials()
    _, line = Reachability().on_failure(str(error), failure_kind(error))
    assert line == ("no credentials are configured: HTTP 401 (the server wants credentials: set "
                    "CONDUCTOR_AUTH_KEY/SECRET) (will keep retrying)")  # fmt: skip
    assert line is not None and line.count("CONDUCTOR_AUTH_KEY") == 1 and "refused our" not in line


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ConductorAuthError("401"), "auth"),
        (_sent_without_credentials(), "no_credentials"),
        (ConductorNotFound("404"), "rejected"),
        (ConductorRejected("400"), "rejected"),
        (ConductorUnavailable("refused"), "unreachable"),
        (ConductorError("other"), "unreachable"),
    ],
)
def test_poll_failures_are_classified(error: ConductorError, kind: str) -> None:
    assert failure_kind(error) == kind


def test_log_buffer_cuts_batches_by_lines_and_bytes() -> None:
    buf = LogBuffer(max_lines=100)
    for i in range(7):
        buf.append(f"line {i}")
    assert buf.take_batch(max_lines=3, max_bytes=10_000) == "line 0\nline 1\nline 2"
    assert buf.take_batch(max_lines=50, max_bytes=14) == "line 3\nline 4"
    assert buf.take_batch(max_lines=50, max_bytes=10_000) == "line 5\nline 6"
    assert buf.take_batch(max_lines=50, max_bytes=10_000) is None


def test_log_buffer_drops_the_oldest_lines_and_says_how_many() -> None:
    buf = LogBuffer(max_lines=3)
    for i in range(10):
        buf.append(str(i))
    assert (
        buf.take_batch(max_lines=50, max_bytes=10_000) == "[conductor-run: 7 output lines dropped]\n7\n8\n9"
    )
    assert buf.dropped == 0


class _StalledLogs:
    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None:
        raise AssertionError("nothing is flushed in this test")


def test_the_log_buffers_of_all_tasks_together_stay_within_their_budget() -> None:
    # A stalled server and many chatty tasks: each buffer alone holds 1000 lines of up to 16 KiB
    # (16 MB per task, found by a QA pass at 551 MB of RSS for 30 tasks). Not started: no flushes.
    streamer = LogStreamer(_StalledLogs(), max_buffered_chars=100_000, batch_lines=10**6)
    sinks = [streamer.open_lines(f"t{i}") for i in range(30)]
    for _ in range(20):
        for sink in sinks:
            sink("stdout", ["x" * 1000] * 10)
    assert streamer.buffered_chars <= 100_000 + 1000  # the budget, plus the newest line kept
    quiet = streamer.open("quiet")  # a task that prints one line still gets it in
    quiet("stdout", "hello")
    assert streamer.buffered_chars <= 100_000 + 1000 + 5
    batches = [streamer._tasks[f"t{i}"].buffer.take_batch(10**6, 10**9) for i in range(30)]
    assert all(b is not None and b.startswith("[conductor-run: ") for b in batches[1:])  # dropped, said so
    assert streamer._tasks["quiet"].buffer.take_batch(10, 10**6) == "hello"


def test_a_task_opened_again_leaves_nothing_of_its_last_run_in_the_budget() -> None:
    # Found in review: the second open replaced the entry, and its unsent characters stayed counted
    # for good (a few such re-polls and every task shed its output down to one line).
    streamer = LogStreamer(_StalledLogs(), max_buffered_chars=100_000, batch_lines=10**6)
    streamer.open_lines("t1")("stdout", ["x" * 100] * 500)
    streamer.close("t1")
    assert streamer.buffered_chars == 50_000
    streamer.open("t1")  # its IN_PROGRESS yield, polled back while the old lines were still unsent
    assert streamer.buffered_chars == 0


def test_a_quiet_task_is_forgotten_at_its_close_without_waking_the_flusher() -> None:
    # Waking the flusher thread for a task with nothing to send was a thread switch per task.
    streamer = LogStreamer(_StalledLogs(), max_buffered_chars=100_000, batch_lines=10**6)
    streamer.open_lines("quiet")
    streamer.close("quiet")
    assert "quiet" not in streamer._tasks and not streamer._wake.is_set()
    # A task with lines left still hands them to the flusher at its close.
    streamer.open_lines("chatty")("stdout", ["last words"])
    streamer.close("chatty")
    assert streamer._tasks["chatty"].closed and streamer._wake.is_set()
    assert streamer._tasks["chatty"].buffer.take_batch(10, 10**6) == "last words"


def test_log_buffer_always_makes_progress_on_a_huge_line() -> None:
    buf = LogBuffer(max_lines=10, max_line_bytes=1000)
    buf.append("x" * 5000)
    batch = buf.take_batch(max_lines=50, max_bytes=100)
    assert batch is not None and batch.endswith("[line truncated]")
    assert len(batch.encode()) <= 1000
    assert len(buf) == 0


@pytest.mark.parametrize(
    ("outcome", "once", "expected"),
    [
        (RunOutcome(started=1, statuses=(TaskStatus.COMPLETED,)), True, exitcodes.OK),
        (RunOutcome(started=1, statuses=(TaskStatus.FAILED,)), True, exitcodes.TASK_FAILED),
        (RunOutcome(started=1, statuses=(None,)), True, exitcodes.TASK_FAILED),
        (RunOutcome(started=0), True, exitcodes.NO_TASK),
        (RunOutcome(started=3, statuses=(TaskStatus.FAILED,) * 3), False, exitcodes.OK),
        (
            RunOutcome(signum=signal.SIGTERM, started=1, statuses=(TaskStatus.FAILED,)),
            True,
            exitcodes.SIGTERM,
        ),
        (RunOutcome(signum=signal.SIGINT), False, exitcodes.SIGINT),
        (RunOutcome(signum=signal.SIGHUP), False, exitcodes.SIGHUP),
        (RunOutcome(poller_failed=True), False, exitcodes.UNEXPECTED),
        (
            RunOutcome(started=1, statuses=(TaskStatus.COMPLETED,), poller_failed=True),
            True,
            exitcodes.UNEXPECTED,
        ),
    ],
)
def test_exit_code_decision(outcome: RunOutcome, once: bool, expected: int) -> None:
    assert exit_code_for(outcome, once=once) == expected


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (RunOutcome(started=3, statuses=(TaskStatus.COMPLETED,) * 3), exitcodes.OK),
        (RunOutcome(started=3, statuses=(TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.COMPLETED)),
         exitcodes.TASK_FAILED),
        (RunOutcome(started=2, statuses=(TaskStatus.COMPLETED, None)), exitcodes.TASK_FAILED),
        (RunOutcome(started=2, statuses=(TaskStatus.FAILED_WITH_TERMINAL_ERROR,) * 2), exitcodes.TASK_FAILED),
        (RunOutcome(signum=signal.SIGTERM, started=1, statuses=(TaskStatus.FAILED,)), exitcodes.SIGTERM),
    ],
)
def test_max_tasks_exit_code_says_whether_every_task_completed(outcome: RunOutcome, expected: int) -> None:
    """--max-tasks is for cron-like callers too: a failed task is exit 5, as with --once."""
    assert exit_code_for(outcome, once=False, max_tasks=3) == expected


def test_whole_entries_are_batches_of_their_own_even_with_newlines_inside() -> None:
    buf = LogBuffer(max_lines=100)
    buf.extend(["[stderr] a", "[stderr] b"])
    buf.extend([WholeEntry("item 1\nsecond line"), WholeEntry("item 2")])
    buf.append("after")
    batches = []
    while (batch := buf.take_batch(max_lines=50, max_bytes=10_000)) is not None:
        batches.append(batch)
    assert batches == ["[stderr] a\n[stderr] b", "item 1\nsecond line", "item 2", "after"]
    assert isinstance(batches[1], WholeEntry)  # a failed send counts it as one dropped entry


def test_an_overflow_note_goes_alone_before_a_whole_entry() -> None:
    buf = LogBuffer(max_lines=2)
    buf.extend([WholeEntry(f"item {n}") for n in range(4)])
    assert buf.take_batch(50, 10_000) == "[conductor-run: 2 output lines dropped]"
    assert buf.take_batch(50, 10_000) == "item 2"
    assert buf.take_batch(50, 10_000) == "item 3"
