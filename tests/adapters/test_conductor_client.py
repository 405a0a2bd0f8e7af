"""ConductorClient: error translation, request shapes, the embedded server, and real network faults."""

from __future__ import annotations

import inspect
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import requests.adapters
import requests.exceptions

from leasecore.conductor.client import ConductorAdmin, ConductorClient, error_for_status, translate_errors
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
    ConductorUnavailable,
    ConfigError,
)
from leasecore.models import TaskLog, TaskResult, TaskStatus
from leasecore.server import EmbeddedServer
from tests.adapters.conftest import Connect
from tests.adapters.fakehttp import Answer, ScriptedServer, Seen
from tests.faultproxy import FaultProxy, Mode
from tests.support import wait_until

# -- error translation ------------------------------------------------------------------------------


def _requests_exception_classes() -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(requests.exceptions, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == "requests.exceptions"
    ]


def _instance(cls: type[BaseException]) -> BaseException:
    if issubclass(cls, requests.exceptions.JSONDecodeError):
        return cls("Expecting value", "<html>", 0)
    return cls("boom")


def test_every_requests_exception_is_mapped() -> None:
    classes = _requests_exception_classes()
    assert len(classes) > 20  # the enumeration really found requests' tree
    for cls in classes:
        original = _instance(cls)
        with pytest.raises(ConductorError) as info, translate_errors("GET", "/tasks/x"):
            raise original
        assert type(info.value) in {
            ConductorUnavailable,
            ConductorRejected,
            ConductorProtocolError,
        }, cls
        assert info.value.__cause__ is original
        assert (info.value.method, info.value.path) == ("GET", "/tasks/x")


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (requests.exceptions.ConnectTimeout, ConductorUnavailable),
        (requests.exceptions.ReadTimeout, ConductorUnavailable),
        (requests.exceptions.ConnectionError, ConductorUnavailable),
        (requests.exceptions.ChunkedEncodingError, ConductorUnavailable),
        (requests.exceptions.SSLError, ConductorUnavailable),
        (requests.exceptions.InvalidURL, ConductorRejected),
        (requests.exceptions.TooManyRedirects, ConductorProtocolError),
        (OSError, ConductorUnavailable),
    ],
)
def test_meaningful_mappings(cls: type[BaseException], expected: type[ConductorError]) -> None:
    with pytest.raises(expected), translate_errors("POST", "/tasks"):
        raise cls("boom")


def test_errors_of_the_tree_pass_through_untouched() -> None:
    original = ConductorNotFound("gone")
    with pytest.raises(ConductorNotFound) as info, translate_errors("GET", "/x"):
        raise original
    assert info.value is original


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, ConductorRejected),
        (401, ConductorAuthError),
        (403, ConductorAuthError),
        (404, ConductorNotFound),
        (409, ConductorRejected),
        (413, ConductorRejected),
        (302, ConductorRejected),
        (500, ConductorUnavailable),
        (502, ConductorUnavailable),
        (503, ConductorUnavailable),
    ],
)
def test_status_mapping(status: int, expected: type[ConductorError]) -> None:
    error = error_for_status("POST", "/tasks", status, b'{"message": "nope"}')
    assert type(error) is expected
    assert error is not None
    assert (error.method, error.path, error.status_code) == ("POST", "/tasks", status)
    assert error.body_excerpt == '{"message": "nope"}'
    assert f"HTTP {status}" in str(error)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"status":500,"message":"JSON parse error","retryable":false}', ConductorRejected),
        (b'{"status":500,"message":"DB down","retryable":true}', ConductorUnavailable),
        (b'{"status":500,"message":"no flag"}', ConductorUnavailable),
        (b'{"retryable":"false"}', ConductorUnavailable),  # only a JSON false counts
        (b"[false]", ConductorUnavailable),
        (b"<html>Bad Gateway</html>", ConductorUnavailable),
        (b"", ConductorUnavailable),
        (b'{"retryable": fal', ConductorUnavailable),
    ],
    ids=["false", "true", "absent", "string", "not-an-object", "html", "empty", "truncated"],
)
def test_a_5xx_is_retryable_unless_its_body_says_retryable_false(
    body: bytes, expected: type[ConductorError]
) -> None:
    for status in (500, 503):
        error = error_for_status("POST", "/tasks", status, body)
        assert type(error) is expected
        assert error is not None
        assert error.status_code == status
        assert error.retryable is (expected is ConductorUnavailable)


def test_success_statuses_are_not_errors() -> None:
    assert error_for_status("GET", "/x", 200, b"") is None
    assert error_for_status("GET", "/x", 204, b"") is None


def test_body_excerpt_is_short_and_redacted() -> None:
    body = ("secret-token " + "word " * 500).encode()
    error = error_for_status("GET", "/x", 500, body, secrets=["secret-token"])
    assert error is not None and error.body_excerpt is not None
    assert len(error.body_excerpt) <= 200
    assert "secret-token" not in error.body_excerpt
    assert error.body_excerpt.startswith("*** word")


class RaisingAdapter(requests.adapters.BaseAdapter):
    """A transport that fails every request with a given requests exception (the session seam)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.sent = 0

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        self.sent += 1
        raise self.error

    def close(self) -> None:
        pass


def test_errors_from_a_mounted_transport_are_translated() -> None:
    session = requests.Session()
    adapter = RaisingAdapter(requests.exceptions.ConnectionError("no route to host"))
    session.mount("http://conductor.test/", adapter)
    client = ConductorClient("http://conductor.test/api", session=session)
    with pytest.raises(ConductorUnavailable) as info:
        client.extend_lease("t1", "w1")
    assert info.value.method == "POST" and info.value.path == "/tasks"
    assert "no route to host" in str(info.value)
    assert adapter.sent == 1  # no retry inside the client
    client.close()
    session.close()


# -- request shapes (scripted server) ------------------------------------------------------------


@pytest.fixture
def scripted(
    connect: Connect,
) -> Iterator[Callable[[Callable[[Seen], Answer]], tuple[ScriptedServer, ConductorClient]]]:
    opened: list[tuple[ScriptedServer, ConductorClient]] = []

    def start(responder: Callable[[Seen], Answer]) -> tuple[ScriptedServer, ConductorClient]:
        server = ScriptedServer(responder)
        client = connect(server.url + "/api", timeout_seconds=5)
        opened.append((server, client))
        return server, client

    yield start
    for server, client in opened:
        client.close()
        server.stop()


TASK_JSON = {
    "taskId": "t-1",
    "workflowInstanceId": "wf-1",
    "taskType": "shell",
    "responseTimeoutSeconds": 30,
    "workflowTask": {"taskDefinition": {"timeoutSeconds": 600}},
    "inputData": {"x": 1},
}


def test_poll_sends_the_batch_long_poll(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(200, json.dumps([TASK_JSON]).encode()))
    tasks = client.poll("shell type", count=3, timeout_ms=500, worker_id="host-1", domain="blue")
    assert [(t.task_id, t.workflow_id, t.timeout_seconds) for t in tasks] == [("t-1", "wf-1", 600)]
    (seen,) = server.seen
    assert seen.method == "GET"
    assert seen.path == "/api/tasks/poll/batch/shell%20type"
    assert seen.query == {"count": ["3"], "timeout": ["500"], "workerid": ["host-1"], "domain": ["blue"]}
    assert seen.headers["user-agent"].startswith("conductor-run/")


@pytest.mark.parametrize("domain", [None, ""])
def test_poll_never_sends_an_empty_domain(scripted: Any, domain: str | None) -> None:
    server, client = scripted(lambda req: Answer(200, b"[]"))
    assert client.poll("shell", count=1, timeout_ms=0, domain=domain) == []
    assert "domain" not in server.seen[0].query
    assert "workerid" not in server.seen[0].query


def test_poll_accepts_204(scripted: Any) -> None:
    _, client = scripted(lambda req: Answer(204))
    assert client.poll("shell", count=1, timeout_ms=100) == []


NESTED_INPUT = json.dumps([TASK_JSON])[:-2].encode() + b', "deep": ' + b"[" * 5000 + b"]" * 5000 + b"}]"


@pytest.mark.parametrize("body", [b"<html>oops</html>", b'{"taskId": "t"}', b"[1, 2]", NESTED_INPUT])
def test_poll_rejects_answers_of_the_wrong_shape(scripted: Any, body: bytes) -> None:
    _, client = scripted(lambda req: Answer(200, body))
    with pytest.raises(ConductorProtocolError) as info:
        client.poll("shell", count=1, timeout_ms=100)
    assert info.value.status_code == 200


def test_poll_waits_past_the_client_timeout_for_a_long_poll(connect: Connect, scripted: Any) -> None:
    # The server holds the poll for its timeout (0.45 s) > the client's default timeout (0.25 s):
    # the HTTP read timeout must be the poll timeout plus a margin.
    def slow(req: Seen) -> Answer:
        threading.Event().wait(0.45)
        return Answer(200, b"[]")

    server = ScriptedServer(slow)
    try:
        with connect(server.url + "/api", timeout_seconds=0.25) as client:
            assert client.poll("shell", count=1, timeout_ms=450) == []
    finally:
        server.stop()


def test_update_is_v1_and_accepts_text(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(200, b"t-1", content_type="text/plain"))
    result = TaskResult(
        task_id="t-1",
        workflow_id="wf-1",
        status=TaskStatus.COMPLETED,
        output_data={"ok": True},
        worker_id="host-1",
        logs=(TaskLog("done", 1700000000000),),
    )
    client.update(result)
    (seen,) = server.seen
    assert (seen.method, seen.path) == ("POST", "/api/tasks")
    assert "text/plain" in seen.headers["accept"]
    assert seen.headers["content-type"] == "application/json"
    assert json.loads(seen.body) == result.to_json()


def test_extend_lease_body(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(200, b"t-1", content_type="text/plain"))
    client.extend_lease("t-1", "wf-1", worker_id="host-1")
    client.extend_lease("t-1", "wf-1")
    bodies = [json.loads(s.body) for s in server.seen]
    base = {"taskId": "t-1", "workflowInstanceId": "wf-1", "status": "IN_PROGRESS", "extendLease": True}
    assert bodies == [{**base, "workerId": "host-1"}, base]
    assert all(s.path == "/api/tasks" for s in server.seen)


def test_append_log_sends_the_raw_text(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(200))
    line = 'progress "50%"\nnext: {not json}'
    client.append_log("t/1", line)
    (seen,) = server.seen
    assert seen.path == "/api/tasks/t%2F1/log"
    assert seen.headers["content-type"].startswith("text/plain")
    assert seen.body.decode() == line


def test_get_task_status(scripted: Any) -> None:
    answers = {
        "/api/tasks/live": Answer(200, json.dumps({"taskId": "live", "status": "CANCELED"}).encode()),
        "/api/tasks/gone": Answer(404, b'{"message": "Task not found for taskId: gone"}'),
        "/api/tasks/odd": Answer(200, b'{"status": "WHATEVER"}'),
    }
    _, client = scripted(lambda req: answers[req.path])
    assert client.get_task_status("live") is TaskStatus.CANCELED
    assert client.get_task_status("gone") is None
    with pytest.raises(ConductorNotFound) as info:
        client.get_task("gone")
    assert "Task not found" in (info.value.body_excerpt or "")
    with pytest.raises(ConductorProtocolError):
        client.get_task_status("odd")


def test_health_is_at_the_server_root(scripted: Any) -> None:
    healthy = {"value": True}

    def answer(req: Seen) -> Answer:
        if req.path != "/health":
            return Answer(404)
        return Answer(200, json.dumps({"healthy": healthy["value"]}).encode())

    _, client = scripted(answer)
    assert client.health() is True
    healthy["value"] = False
    assert client.health() is False


def test_health_of_an_unreachable_server_raises(connect: Connect) -> None:
    with FaultProxy("127.0.0.1", 9) as proxy:  # nothing to forward to; refuse anyway
        proxy.set_mode(Mode.REFUSE)
        with (
            connect(proxy.url_for("/api"), timeout_seconds=2) as client,
            pytest.raises(ConductorUnavailable),
        ):
            client.health()


def test_server_errors_are_not_retried(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(503, b'{"message": "busy", "retryable": true}'))
    with pytest.raises(ConductorUnavailable) as info:
        client.get_task("t-1")
    assert info.value.status_code == 503
    assert info.value.retryable
    assert len(server.seen) == 1


def test_redirects_are_not_followed(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(301, headers={"Location": "https://elsewhere/api/tasks"}))
    with pytest.raises(ConductorRejected, match="redirect"):
        client.update(TaskResult("t", "w", TaskStatus.COMPLETED))
    assert len(server.seen) == 1


def test_auth_error_without_credentials_says_what_to_set(scripted: Any) -> None:
    _, client = scripted(lambda req: Answer(401, b'{"error": "INVALID_TOKEN"}'))
    with pytest.raises(ConductorAuthError, match="CONDUCTOR_AUTH_KEY"):
        client.get_task("t-1")


def test_no_time_left_means_no_attempt(scripted: Any) -> None:
    server, client = scripted(lambda req: Answer(200, b"t"))
    with pytest.raises(ConductorUnavailable, match="no time left"):
        client.extend_lease("t", "w", timeout_seconds=0)
    assert server.seen == []


@pytest.mark.parametrize("url", ["localhost:8080/api", "ftp://host/api", "http:///api", ""])
def test_bad_base_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        ConductorClient(url)
    assert info.value.key == "server.url"


def test_half_credentials_are_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        ConductorClient("http://localhost:8080/api", auth_key="k")
    assert info.value.key == "auth_secret"
    assert "k" not in repr(ConductorClient("http://localhost:8080/api", auth_key="k", auth_secret="sss"))


def test_sixteen_threads_share_the_pool_without_dropping_connections(
    connect: Connect, scripted: Any, caplog: pytest.LogCaptureFixture
) -> None:
    barrier = threading.Barrier(16)

    def answer(req: Seen) -> Answer:
        return Answer(200, b"t", content_type="text/plain")

    _, client = scripted(answer)

    def beat() -> None:
        barrier.wait(10)
        for _ in range(5):
            client.extend_lease("t", "w")

    with caplog.at_level(logging.WARNING, logger="urllib3"), ThreadPoolExecutor(16) as pool:
        for future in [pool.submit(beat) for _ in range(16)]:
            future.result(timeout=60)
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]
    if connect.kind == "lean":  # 80 calls from 16 threads, at most one connection per thread
        assert client.connections_opened is not None and 1 <= client.connections_opened <= 16
    else:  # urllib3's pool does not count; its "pool is full" warning (checked above) is the symptom
        assert client.connections_opened is None


# -- the embedded server ---------------------------------------------------------------------------


def start_one_task(client: ConductorClient, task_type: str) -> str:
    admin = ConductorAdmin(client)
    admin.register_task_defs(
        [{"name": task_type, "retryCount": 0, "responseTimeoutSeconds": 60, "retryDelaySeconds": 0}]
    )
    workflow = {
        "name": f"wf_{task_type}",
        "version": 1,
        "schemaVersion": 2,
        "tasks": [{"name": task_type, "taskReferenceName": "step", "type": "SIMPLE"}],
    }
    admin.register_workflow(workflow)
    admin.register_workflow(workflow, overwrite=True)  # idempotent re-registration works too
    return admin.start_workflow(f"wf_{task_type}", {"who": "ada"})


def test_round_trip_against_the_embedded_server(connect: Connect, server: EmbeddedServer) -> None:
    task_type = f"rt_{uuid.uuid4().hex[:8]}"
    with connect(server.url, timeout_seconds=5) as client:
        admin = ConductorAdmin(client)
        assert client.health()
        workflow_id = start_one_task(client, task_type)
        (task,) = client.poll(task_type, count=5, timeout_ms=1000, worker_id="host-1")
        assert task.workflow_id == workflow_id
        assert task.input_data == {"who": "ada"} or task.input_data == {}
        assert task.response_timeout_seconds == 60
        client.extend_lease(task.task_id, task.workflow_id, worker_id="host-1")
        assert client.get_task_status(task.task_id) is TaskStatus.IN_PROGRESS
        client.append_log(task.task_id, "half way: 50%")
        client.update(
            TaskResult(task.task_id, workflow_id, TaskStatus.COMPLETED, {"answer": 42}, worker_id="host-1")
        )
        assert client.get_task_status(task.task_id) is TaskStatus.COMPLETED
        assert [entry["log"] for entry in admin.get_logs(task.task_id)] == ["half way: 50%"]
        workflow = admin.get_workflow(workflow_id)
        assert workflow["status"] == "COMPLETED"
        assert workflow["tasks"][0]["outputData"] == {"answer": 42}


def test_empty_long_poll_returns_no_tasks_after_its_timeout(
    connect: Connect, server: EmbeddedServer
) -> None:
    with connect(server.url, timeout_seconds=5) as client:
        started = time.monotonic()
        assert client.poll(f"none_{uuid.uuid4().hex[:8]}", count=1, timeout_ms=300) == []
        assert time.monotonic() - started >= 0.25


def test_terminated_workflow_cancels_the_task(connect: Connect, server: EmbeddedServer) -> None:
    task_type = f"term_{uuid.uuid4().hex[:8]}"
    with connect(server.url, timeout_seconds=5) as client:
        admin = ConductorAdmin(client)
        workflow_id = start_one_task(client, task_type)
        (task,) = client.poll(task_type, count=1, timeout_ms=1000)
        admin.terminate_workflow(workflow_id, "operator said so")
        assert client.get_task_status(task.task_id) is TaskStatus.CANCELED
        client.extend_lease(task.task_id, workflow_id)  # a heartbeat cannot tell: still 200
        assert client.get_task_status("no-such-task") is None
        with pytest.raises(ConductorNotFound):
            client.extend_lease("no-such-task", workflow_id)


def test_a_malformed_request_500_is_rejected_not_retryable(
    connect: Connect, server: EmbeddedServer
) -> None:
    task_type = f"err_{uuid.uuid4().hex[:8]}"
    with connect(server.url, timeout_seconds=5) as client:
        workflow_id = start_one_task(client, task_type)
        (task,) = client.poll(task_type, count=1, timeout_ms=1000)
        with pytest.raises(ConductorRejected) as info:
            # The 500 body says "retryable": false: retrying the same request can never succeed.
            # A non-lease update without a status is a 500 on the real server (§3 step 7).
            client.request(
                "POST", "/tasks", json_body={"taskId": task.task_id, "workflowInstanceId": workflow_id}
            )
        assert info.value.status_code == 500
        assert not info.value.retryable
        assert "status" in (info.value.body_excerpt or "")
        with pytest.raises(ConductorRejected) as bad:
            client.poll(task_type, count=1, timeout_ms=6000)  # > 5000 ms: 400
        assert bad.value.status_code == 400


def test_token_auth_against_the_embedded_server(connect: Connect) -> None:
    with (
        EmbeddedServer(host="127.0.0.1", port=0, auth_key="kid", auth_secret="ksecret") as srv,
        connect(srv.url, auth_key="kid", auth_secret="ksecret", timeout_seconds=5) as client,
    ):
        assert client.poll("anything", count=1, timeout_ms=0) == []
        srv.expire_tokens()
        assert client.poll("anything", count=1, timeout_ms=0) == []  # refreshed and retried
        assert client.auth is not None and client.auth.fetch_count == 2
        with (
            connect(srv.url, auth_key="kid", auth_secret="wrong", timeout_seconds=5) as bad,
            pytest.raises(ConductorAuthError) as info,
        ):
            bad.poll("anything", count=1, timeout_ms=0)
        assert "wrong" not in str(info.value)
        with (
            connect(srv.url, timeout_seconds=5) as anonymous,
            pytest.raises(ConductorAuthError, match="CONDUCTOR_AUTH_KEY"),
        ):
            anonymous.poll("anything", count=1, timeout_ms=0)


def test_short_lived_tokens_are_refreshed(connect: Connect, server: EmbeddedServer) -> None:
    with (
        EmbeddedServer(host="127.0.0.1", port=0, auth_key="k", auth_secret="s", token_ttl_seconds=0.5) as srv,
        connect(srv.url, auth_key="k", auth_secret="s", timeout_seconds=5) as client,
    ):
        client.poll("anything", count=1, timeout_ms=0)
        assert client.auth is not None
        assert wait_until(lambda: _poll_and_count(client) >= 2)


def _poll_and_count(client: ConductorClient) -> int:
    client.poll("anything", count=1, timeout_ms=100)
    assert client.auth is not None
    return client.auth.fetch_count


def test_oss_server_without_token_endpoint_means_no_auth(
    connect: Connect, server: EmbeddedServer
) -> None:
    with connect(server.url, auth_key="k", auth_secret="s", timeout_seconds=5) as client:
        assert client.poll("anything", count=1, timeout_ms=0) == []
        assert client.auth is not None and client.auth.no_auth


# -- network faults through the proxy ---------------------------------------------------------------


@pytest.fixture
def proxied(connect: Connect, server: EmbeddedServer) -> Iterator[tuple[FaultProxy, ConductorClient]]:
    with (
        FaultProxy("127.0.0.1", server.port) as proxy,
        connect(proxy.url_for("/api"), timeout_seconds=5) as client,
    ):
        yield proxy, client


def test_refused_is_unavailable_quickly(proxied: tuple[FaultProxy, ConductorClient]) -> None:
    proxy, client = proxied
    proxy.set_mode(Mode.REFUSE)
    started = time.monotonic()
    with pytest.raises(ConductorUnavailable) as info:
        client.get_task_status("t", timeout_seconds=5)
    assert time.monotonic() - started < 2.5
    assert info.value.status_code is None
    proxy.set_mode(Mode.PASS)
    assert client.get_task_status("t", timeout_seconds=5) is None


def test_reset_is_unavailable(proxied: tuple[FaultProxy, ConductorClient]) -> None:
    proxy, client = proxied
    assert client.health()  # a pooled connection exists; the reset kills it too
    proxy.set_mode(Mode.RESET)
    with pytest.raises(ConductorUnavailable):
        client.extend_lease("t", "w", timeout_seconds=5)


@pytest.mark.parametrize("established", [False, True])
def test_blackhole_returns_within_the_timeout(
    proxied: tuple[FaultProxy, ConductorClient], established: bool
) -> None:
    proxy, client = proxied
    if established:
        assert client.health()  # the stall hits a pooled, already connected socket
    proxy.set_mode(Mode.BLACKHOLE)
    started = time.monotonic()
    with pytest.raises(ConductorUnavailable, match=r"timed out|Timeout"):
        client.extend_lease("t", "w", timeout_seconds=1.0)
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 3.0  # no HTTP attempt outlives its budget


def test_slow_answer_is_bounded_by_the_attempt_budget(proxied: tuple[FaultProxy, ConductorClient]) -> None:
    proxy, client = proxied
    proxy.set_mode(Mode.LATENCY, latency_seconds=1.5)
    started = time.monotonic()
    with pytest.raises(ConductorUnavailable):
        client.get_task_status("t", timeout_seconds=1.0)
    assert time.monotonic() - started < 3.5


def test_long_poll_through_a_blackhole_is_bounded_by_poll_timeout_plus_margin(
    connect: Connect, server: EmbeddedServer
) -> None:
    with (
        FaultProxy("127.0.0.1", server.port) as proxy,
        connect(proxy.url_for("/api"), timeout_seconds=1.0) as client,
    ):
        proxy.set_mode(Mode.BLACKHOLE)
        started = time.monotonic()
        with pytest.raises(ConductorUnavailable):
            client.poll("shell", count=1, timeout_ms=500)
        assert 1.4 <= time.monotonic() - started < 4.0


@pytest.mark.parametrize("fault", [Mode.RESET, Mode.BLACKHOLE])
def test_recovers_once_the_network_is_back(proxied: tuple[FaultProxy, ConductorClient], fault: Mode) -> None:
    proxy, client = proxied
    # Warm the pool with several connections, then break them all.
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda _: client.health(), range(8)))
    proxy.set_mode(fault)
    with pytest.raises(ConductorUnavailable):
        client.get_task_status("t", timeout_seconds=0.5)
    proxy.set_mode(Mode.PASS)
    # No dead pooled connection poisons a later call: every one of them succeeds.
    for _ in range(10):
        assert client.get_task_status("t", timeout_seconds=5) is None
    assert client.health()


def test_a_refused_connection_is_described_plainly(connect: Connect) -> None:
    """The operator reads "connection refused", not urllib3's pool internals."""
    with socket.socket() as probe:  # a port nothing listens on: bind, then close
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = connect(f"http://127.0.0.1:{port}/api", timeout_seconds=2)
    try:
        with pytest.raises(ConductorUnavailable) as caught:
            client.get_task("t1")
    finally:
        client.close()
    assert "connection refused" in str(caught.value)
    assert "HTTPConnectionPool" not in str(caught.value)
