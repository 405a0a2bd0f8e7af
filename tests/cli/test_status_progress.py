"""A checkpoint's progress in ``conductor-run status``: a PROGRESS column only when a task gives one
(other views stay as they were), a row in the task view, and ``progress`` in the JSON."""

from __future__ import annotations

from cli.render import render_status, render_task
from leasecore.snapshot import TaskSnapshot
from tests.cli.test_status import NOW, a_record, a_task, to_text


def test_the_column_shows_only_when_a_task_gives_a_progress() -> None:
    plain = to_text(render_status([a_record(a_task())], NOW), width=200)
    assert "PROGRESS" not in plain
    two = [a_task(progress=0.426), a_task(task_id="8a4d2b3f-2222-4333-8444-555566667777")]
    shown = to_text(render_status([a_record(*two)], NOW), width=200)
    header = next(line for line in shown.splitlines() if "PROGRESS" in line)
    assert header.index("LEASE") < header.index("PROGRESS") < header.index("ELAPSED")
    rows = [line for line in shown.splitlines() if "encode_video" in line]
    assert " 43% " in rows[0] and " - " in rows[1]


def test_a_narrow_terminal_leaves_the_progress_column_out_first() -> None:
    narrow = to_text(render_status([a_record(a_task(progress=0.5))], NOW), width=100)
    assert "PROGRESS" not in narrow and "TASK" in narrow


def test_the_task_view_has_a_progress_row_when_there_is_one() -> None:
    assert "progress" not in to_text(render_task(a_record(a_task()), a_task(), NOW))
    task = a_task(progress=1.0)
    assert "100%" in to_text(render_task(a_record(task), task, NOW))


def test_progress_round_trips_through_the_status_file_json() -> None:
    task = a_task(progress=0.25)
    assert task.to_json_dict()["progress"] == 0.25
    assert TaskSnapshot.from_json_dict(task.to_json_dict()).progress == 0.25
    assert a_task().to_json_dict()["progress"] is None
    for junk in ("50%", 2, True, None):  # an older or foreign file: no progress, never a crash
        assert TaskSnapshot.from_json_dict({**task.to_json_dict(), "progress": junk}).progress is None
