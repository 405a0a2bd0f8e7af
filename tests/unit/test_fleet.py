"""The fleet rows (leasecore/fleet/view.py): joining queue sizes and poll records, stalled types first."""

from __future__ import annotations

from typing import Any

from leasecore.fleet.view import ACTIVE_POLL_SECONDS, fleet_document, fleet_rows, split_queue_name

NOW = 1_800_000_000_000  # ms


def poll(
    task_type: str, age_s: float, worker: str | None = None, domain: str | None = None
) -> dict[str, Any]:
    record: dict[str, Any] = {"queueName": task_type, "lastPollTime": int(NOW - age_s * 1000)}
    if worker is not None:
        record["workerId"] = worker
    if domain is not None:
        record["domain"] = domain
    return record


def test_queue_names_split_into_type_and_domain() -> None:
    assert split_queue_name("encode") == ("encode", None)
    assert split_queue_name("gpu:encode") == ("encode", "gpu")
    assert split_queue_name(":encode") == ("encode", "")


def test_rows_join_depths_and_pollers_per_type_and_domain() -> None:
    sizes = {"a": 0, "gpu:a": 3, "b": 2, "_deciderQueue": 9}
    polls = [poll("a", 1.5, "w1"), poll("a", 0.5, "w2", domain="gpu"), poll("c", 2.0, "w3")]
    rows = {(r.task_type, r.domain): r for r in fleet_rows(sizes, polls, now_ms=NOW)}
    assert set(rows) == {("a", None), ("a", "gpu"), ("b", None), ("c", None)}  # no _deciderQueue
    assert rows["a", "gpu"].queue_depth == 3
    assert [(w.worker_id, w.last_poll_age_seconds) for w in rows["a", "gpu"].workers] == [("w2", 0.5)]
    assert rows["c", None].queue_depth == 0  # polled, never queued
    assert rows["b", None].workers == ()
    assert rows["b", None].stalled and rows["b", None].state == "stalled"
    assert rows["a", None].state == "active"


def test_stalled_types_come_first_deepest_first_then_the_rest_by_name() -> None:
    sizes = {"z_ok": 5, "m_stalled": 1, "a_idle": 0, "k_stalled": 4, "b_old": 2}
    polls = [poll("z_ok", 1, "w"), poll("b_old", ACTIVE_POLL_SECONDS + 0.5, "gone")]
    order = [(r.task_type, r.state) for r in fleet_rows(sizes, polls, now_ms=NOW)]
    assert order == [
        ("k_stalled", "stalled"), ("b_old", "stalled"), ("m_stalled", "stalled"),
        ("a_idle", "idle"), ("z_ok", "active"),
    ]


def test_a_poll_exactly_at_the_limit_still_counts_and_one_just_past_does_not() -> None:
    at_limit = fleet_rows({"t": 1}, [poll("t", ACTIVE_POLL_SECONDS, "w")], now_ms=NOW)[0]
    past = fleet_rows({"t": 1}, [poll("t", ACTIVE_POLL_SECONDS + 0.001, "w")], now_ms=NOW)[0]
    assert not at_limit.stalled
    assert past.stalled


def test_a_server_clock_ahead_of_ours_gives_age_zero_not_a_negative_age() -> None:
    (row,) = fleet_rows({}, [poll("t", -3.0, "w")], now_ms=NOW)
    assert row.workers[0].last_poll_age_seconds == 0.0


def test_task_type_filter_keeps_every_domain_and_names_unknown_types() -> None:
    sizes = {"a": 1, "gpu:a": 2, "b": 7}
    rows = fleet_rows(sizes, [poll("a", 1, "w")], now_ms=NOW, task_types=["a", "nobody"])
    assert [(r.task_type, r.domain, r.queue_depth) for r in rows] == [
        ("a", "gpu", 2), ("a", None, 1), ("nobody", None, 0)  # stalled (deepest first), then by name
    ]


def test_workers_are_listed_most_recent_first_and_a_missing_worker_id_is_none() -> None:
    (row,) = fleet_rows({}, [poll("t", 4, "old"), poll("t", 1), poll("t", 2, "mid")], now_ms=NOW)
    assert [w.worker_id for w in row.workers] == [None, "mid", "old"]


def test_the_json_document_has_the_documented_shape() -> None:
    rows = fleet_rows({"t": 1, "gpu:u": 0}, [poll("u", 0.25, "w", domain="gpu")], now_ms=NOW)
    doc = fleet_document("http://h:8080/api", rows)
    assert doc == {
        "server": "http://h:8080/api",
        "activePollSeconds": ACTIVE_POLL_SECONDS,
        "taskTypes": [
            {"taskType": "t", "domain": None, "queueDepth": 1, "state": "stalled", "stalled": True,
             "workers": []},
            {"taskType": "u", "domain": "gpu", "queueDepth": 0, "state": "active", "stalled": False,
             "workers": [{"workerId": "w", "lastPollAgeSeconds": 0.25}]},
        ],
    }
