"""What a failed delivery of a saved result means is the final-update table's (leasecore.lease.
finalfailure), as for the reporter: kept while unreachable, dropped on a refusal, a refused body sent
bare once, a 2xx we could not read counted delivered. Real files in a temporary outbox."""

from __future__ import annotations

from pathlib import Path

from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
    ConductorUnavailable,
)
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.state.outbox import DeliveryReport, Outbox

URL = "http://127.0.0.1:8080/api"
DONE = TaskResult("t1", "w1", TaskStatus.COMPLETED, output_data={"big": "x" * 100}, worker_id="host")


def deliver(tmp_path: Path, *answers: ConductorError | None
            ) -> tuple[DeliveryReport, list[TaskResult], Outbox]:  # fmt: skip
    outbox = Outbox(tmp_path / "outbox", server=URL)
    outbox.save(DONE, poll_count=3)
    sent: list[TaskResult] = []
    script = list(answers)

    def update(result: TaskResult) -> None:
        sent.append(result)
        answer = script.pop(0) if script else None
        if answer is not None:
            raise answer

    report = outbox.deliver(update, read_task=lambda _: TaskOwnership(TaskStatus.IN_PROGRESS, 3, "host"))
    return report, sent, outbox


def test_a_refused_body_goes_out_bare_once_and_the_entry_is_dropped(tmp_path: Path) -> None:
    report, sent, outbox = deliver(tmp_path, ConductorRejected("too large", status_code=413))
    assert [r.status for r in sent] == [TaskStatus.COMPLETED, TaskStatus.FAILED]
    assert sent[1].output_data == {} and "refused" in (sent[1].reason_for_incompletion or "")
    assert report == DeliveryReport(dropped=1) and outbox.entries() == []


def test_a_refused_bare_failed_is_not_sent_again(tmp_path: Path) -> None:
    report, sent, outbox = deliver(tmp_path, ConductorRejected("bad", status_code=400),
                                   ConductorRejected("bad", status_code=400))
    assert len(sent) == 2 and report == DeliveryReport(dropped=1) and outbox.entries() == []


def test_a_garbled_2xx_counts_as_delivered(tmp_path: Path) -> None:
    report, sent, outbox = deliver(tmp_path, ConductorProtocolError("not JSON", status_code=200))
    assert len(sent) == 1 and report == DeliveryReport(delivered=1) and outbox.entries() == []


def test_gone_and_conflict_drop_without_a_bare_failed(tmp_path: Path) -> None:
    for exc in (ConductorNotFound("gone", status_code=404), ConductorRejected("conflict", status_code=409)):
        report, sent, outbox = deliver(tmp_path / str(exc.status_code), exc)
        assert len(sent) == 1 and report == DeliveryReport(dropped=1) and outbox.entries() == []


def test_unreachable_or_refused_credentials_keep_it(tmp_path: Path) -> None:
    for exc in (ConductorUnavailable("timed out"), ConductorUnavailable("server error", status_code=500),
                ConductorAuthError("refused", status_code=401)):
        report, sent, outbox = deliver(tmp_path / type(exc).__name__ / str(exc.status_code), exc)
        assert len(sent) == 1 and report == DeliveryReport(kept=1) and len(outbox.entries()) == 1
