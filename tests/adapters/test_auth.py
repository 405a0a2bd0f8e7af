"""Token auth: the pure refresh rules (FakeClock, counting fake fetcher) and the HTTP token flow."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from leasecore.clock import FakeClock
from leasecore.conductor.auth import TokenManager, jwt_expiry_epoch_seconds
from leasecore.conductor.client import ConductorClient
from leasecore.errors import ConductorAuthError, ConductorError, ConductorUnavailable
from tests.adapters.fakehttp import Answer, ScriptedServer, Seen
from tests.support import wait_until

KEY_ID = "key-id-123"
KEY_SECRET = "s3cr3t-KEY-value"


def make_jwt(exp: float | None, **claims: object) -> str:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    body = dict(claims)
    if exp is not None:
        body["exp"] = exp
    return f"{b64(b'{}')}.{b64(json.dumps(body).encode())}.{b64(b'signature')}"


class FakeFetcher:
    """Hands out token-1, token-2, ...; can block on a gate or fail."""

    def __init__(self, tokens: list[str | None] | None = None) -> None:
        self.calls = 0
        self.tokens = tokens
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.error: ConductorError | None = None

    def __call__(self, timeout_seconds: float) -> str | None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.error is not None:
            raise self.error
        if self.tokens is not None:
            return self.tokens[min(self.calls, len(self.tokens)) - 1]
        return f"token-{self.calls}"


# -- pure rules ------------------------------------------------------------------------------------


def test_token_is_fetched_once_and_reused_until_the_ttl() -> None:
    clock, fetch = FakeClock(), FakeFetcher()
    manager = TokenManager(fetch, clock=clock, ttl_seconds=2700)
    assert manager.current(5) == "token-1"
    clock.advance(2699)
    assert manager.current(5) == "token-1"
    assert fetch.calls == 1
    clock.advance(2)
    assert manager.current(5) == "token-2"
    assert manager.fetch_count == 2


def test_jwt_is_refreshed_before_its_exp() -> None:
    # Given a JWT valid for one hour by the wall clock
    clock = FakeClock()
    exp = clock.now().timestamp() + 3600
    fetch = FakeFetcher([make_jwt(exp), "next"])
    manager = TokenManager(fetch, clock=clock)
    first = manager.current(5)
    # When 5 minutes before exp is not reached yet, then no refresh
    clock.advance(3299)
    assert manager.current(5) == first
    # When it is, then the token is refreshed proactively
    clock.advance(2)
    assert manager.current(5) == "next"


def test_short_lived_jwt_is_refreshed_at_80_percent_of_its_life() -> None:
    clock = FakeClock()
    fetch = FakeFetcher([make_jwt(clock.now().timestamp() + 10), "next"])
    manager = TokenManager(fetch, clock=clock)
    first = manager.current(5)
    clock.advance(7.9)
    assert manager.current(5) == first
    clock.advance(0.2)
    assert manager.current(5) == "next"


def test_jwt_already_expired_by_our_clock_falls_back_to_the_ttl() -> None:
    clock = FakeClock()
    fetch = FakeFetcher([make_jwt(clock.now().timestamp() - 100)])
    manager = TokenManager(fetch, clock=clock, ttl_seconds=60)
    manager.current(5)
    clock.advance(59)
    manager.current(5)
    assert fetch.calls == 1


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("opaque-token", None),
        ("a.b.c", None),  # not base64 JSON
        (make_jwt(None, sub="x"), None),  # no exp
        (make_jwt(True), None),  # type: ignore[arg-type]  # a bool is not a time
        (make_jwt(1_900_000_000), 1_900_000_000.0),
        (make_jwt(1_900_000_000.5), 1_900_000_000.5),
    ],
)
def test_jwt_exp_parsing(token: str, expected: float | None) -> None:
    assert jwt_expiry_epoch_seconds(token) == expected


def test_no_token_endpoint_means_no_auth_for_good() -> None:
    clock, fetch = FakeClock(), FakeFetcher([None])
    manager = TokenManager(fetch, clock=clock)
    assert manager.current(5) is None
    clock.advance(10 * 3600)
    assert manager.current(5) is None
    assert manager.no_auth
    assert fetch.calls == 1


def test_rejected_token_is_refreshed_unless_someone_already_did() -> None:
    clock, fetch = FakeClock(), FakeFetcher()
    manager = TokenManager(fetch, clock=clock)
    assert manager.current(5) == "token-1"
    assert manager.refresh_rejected("token-1", 5) == "token-2"
    # A thread that still holds token-1 gets token-2 without another fetch.
    assert manager.refresh_rejected("token-1", 5) == "token-2"
    assert fetch.calls == 2


def test_failed_proactive_refresh_keeps_a_token_that_has_not_expired() -> None:
    clock = FakeClock()
    jwt = make_jwt(clock.now().timestamp() + 100)
    fetch = FakeFetcher([jwt])
    manager = TokenManager(fetch, clock=clock)
    assert manager.current(5) == jwt
    fetch.error = ConductorUnavailable("down")
    clock.advance(90)  # past refresh_at (80 s), before exp (100 s)
    assert manager.current(5) == jwt
    clock.advance(11)  # past exp: nothing usable is left
    with pytest.raises(ConductorUnavailable):
        manager.current(5)


def test_failed_reactive_refresh_raises() -> None:
    clock, fetch = FakeClock(), FakeFetcher()
    manager = TokenManager(fetch, clock=clock)
    manager.current(5)
    fetch.error = ConductorAuthError("bad credentials")
    with pytest.raises(ConductorAuthError):
        manager.refresh_rejected("token-1", 5)


def _race(manager: TokenManager, fetch: FakeFetcher, threads: int) -> list[object]:
    """``threads`` callers of refresh_rejected('token-1') while the first fetch is held open."""
    fetch.gate = threading.Event()
    start = threading.Barrier(threads)

    def call() -> object:
        start.wait(10)
        try:
            return manager.refresh_rejected("token-1", 10)
        except ConductorError as exc:
            return exc

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(call) for _ in range(threads)]
        assert fetch.entered.wait(10)
        # Open the gate only once every other thread is queued behind the fetch in progress.
        wait_until(lambda: manager.waiting >= threads - 1, 10, "every other thread to queue behind the fetch",
                   interval_seconds=0.005)
        assert manager.waiting == threads - 1
        fetch.gate.set()
        return [f.result(timeout=10) for f in futures]


def test_concurrent_rejections_share_one_refresh() -> None:
    clock, fetch = FakeClock(), FakeFetcher()
    manager = TokenManager(fetch, clock=clock)
    manager.current(5)
    fetch.entered.clear()
    results = _race(manager, fetch, threads=16)
    assert results == ["token-2"] * 16
    assert fetch.calls == 2  # the first token, and one refresh for all 16 threads


def test_concurrent_rejections_share_one_failure() -> None:
    clock, fetch = FakeClock(), FakeFetcher()
    manager = TokenManager(fetch, clock=clock)
    manager.current(5)
    fetch.entered.clear()
    fetch.error = ConductorUnavailable("token endpoint down")
    results = _race(manager, fetch, threads=8)
    assert all(isinstance(r, ConductorUnavailable) for r in results)
    assert len({id(r) for r in results}) == 8  # each thread raises its own exception object
    assert fetch.calls == 2


def test_waiting_for_a_refresh_is_bounded_by_the_callers_timeout() -> None:
    clock, fetch = FakeClock(), FakeFetcher()
    manager = TokenManager(fetch, clock=clock)
    fetch.gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(manager.current, 10)
        assert fetch.entered.wait(10)
        started = time.monotonic()
        with pytest.raises(ConductorUnavailable, match="waiting for the auth token"):
            manager.current(0.2)
        assert time.monotonic() - started < 5
        fetch.gate.set()
        assert first.result(timeout=10) == "token-1"


def test_repr_shows_no_token() -> None:
    manager = TokenManager(FakeFetcher(["the-token-value"]), clock=FakeClock())
    manager.current(5)
    assert "the-token-value" not in repr(manager)


# -- HTTP token flow ----------------------------------------------------------------------------------


class TokenServer:
    """Issues token-N on /api/token; rejects expired tokens with 401 EXPIRED_TOKEN."""

    def __init__(self, token_status: int = 200) -> None:
        self.token_status = token_status
        self.auth_enabled = token_status == 200
        self.issued = 0
        self.valid: set[str] = set()
        self.lock = threading.Lock()
        self.hold: threading.Event | None = None  # when set, protected calls wait for it

    def expire_all(self) -> None:
        with self.lock:
            self.valid.clear()

    def __call__(self, req: Seen) -> Answer:
        if req.path == "/api/token":
            if self.token_status != 200:
                return Answer(self.token_status, b'{"message": "no"}')
            body = json.loads(req.body)
            if body != {"keyId": KEY_ID, "keySecret": KEY_SECRET}:
                return Answer(401, json.dumps({"message": f"bad key {body.get('keySecret')}"}).encode())
            with self.lock:
                self.issued += 1
                token = f"tok-{self.issued}-{'x' * 20}"
                self.valid.add(token)
            return Answer(200, json.dumps({"token": token}).encode())
        token = req.headers.get("x-authorization")
        if self.auth_enabled:
            with self.lock:
                ok = token in self.valid
            if not ok:
                return Answer(401, json.dumps({"error": "EXPIRED_TOKEN", "token": token}).encode())
        return Answer(200, json.dumps({"taskId": "t1", "status": "IN_PROGRESS"}).encode())


@pytest.fixture
def token_server() -> Iterator[tuple[TokenServer, ScriptedServer]]:
    logic = TokenServer()
    with ScriptedServer(logic) as srv:
        yield logic, srv


def test_token_is_sent_on_every_call_but_not_to_the_token_endpoint(
    token_server: tuple[TokenServer, ScriptedServer],
) -> None:
    _, srv = token_server
    with ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client:
        assert client.get_task_status("t1") == "IN_PROGRESS"
        client.get_task("t1")
    token_calls = srv.requests_to("/api/token")
    assert len(token_calls) == 1
    assert "x-authorization" not in token_calls[0].headers
    assert json.loads(token_calls[0].body) == {"keyId": KEY_ID, "keySecret": KEY_SECRET}
    others = [s for s in srv.seen if s.path != "/api/token"]
    assert [s.headers.get("x-authorization") for s in others] == [f"tok-1-{'x' * 20}"] * 2


def test_expired_token_is_refreshed_and_the_call_retried_once(
    token_server: tuple[TokenServer, ScriptedServer],
) -> None:
    logic, srv = token_server
    with ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client:
        client.get_task("t1")
        logic.expire_all()
        assert client.get_task("t1")["taskId"] == "t1"
    assert logic.issued == 2
    assert [s.path for s in srv.seen].count("/api/tasks/t1") == 3  # ok, 401, retried ok


def test_rejected_again_after_refresh_is_an_auth_error() -> None:
    def always_401(req: Seen) -> Answer:
        if req.path == "/api/token":
            return Answer(200, b'{"token": "never-good-token"}')
        return Answer(401, b'{"error": "INVALID_TOKEN"}')

    with (
        ScriptedServer(always_401) as srv,
        ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client,
    ):
        with pytest.raises(ConductorAuthError) as info:
            client.get_task("t1")
        assert info.value.status_code == 401
        assert len(srv.requests_to("/api/tasks/t1")) == 2  # one retry, no more
        assert "never-good-token" not in str(info.value)


@pytest.mark.parametrize("status", [404, 405])
def test_token_endpoint_missing_means_no_auth(status: int, caplog: pytest.LogCaptureFixture) -> None:
    logic = TokenServer(token_status=status)
    with (
        caplog.at_level(logging.WARNING, logger="leasecore"),
        ScriptedServer(logic) as srv,
        ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client,
    ):
        for _ in range(3):
            client.get_task("t1")
    assert len(srv.requests_to("/api/token")) == 1
    assert all("x-authorization" not in s.headers for s in srv.seen)
    assert sum("without auth" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_bad_credentials_are_an_auth_error_without_the_secret() -> None:
    def echo_secret(req: Seen) -> Answer:
        # A careless server that echoes what it got: the client must still not surface the secret.
        return Answer(401, b"rejected " + req.body)

    with (
        ScriptedServer(echo_secret) as srv,
        ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client,
        pytest.raises(ConductorAuthError) as info,
    ):
        client.get_task("t1")
    error = info.value
    for text in (str(error), repr(error), error.body_excerpt or "", repr(client)):
        assert KEY_SECRET not in text
    assert "***" in (error.body_excerpt or "")


def test_concurrent_threads_with_an_expired_token_cause_one_token_call(
    token_server: tuple[TokenServer, ScriptedServer],
) -> None:
    logic, srv = token_server
    with ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client:
        client.get_task("t1")
        logic.expire_all()
        start = threading.Barrier(16)

        def call() -> str:
            start.wait(10)
            return str(client.get_task("t1", timeout_seconds=20)["taskId"])

        with ThreadPoolExecutor(16) as pool:
            results = [f.result(timeout=60) for f in [pool.submit(call) for _ in range(16)]]
    assert results == ["t1"] * 16
    assert logic.issued == 2  # the first token, and exactly one refresh


def test_no_secret_or_token_in_logs(
    token_server: tuple[TokenServer, ScriptedServer], caplog: pytest.LogCaptureFixture
) -> None:
    logic, srv = token_server
    with (
        caplog.at_level(logging.DEBUG),
        ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client,
    ):
        client.get_task("t1")
        logic.expire_all()
        client.get_task("t1")
        logic.token_status = 503
        logic.expire_all()
        with pytest.raises(ConductorUnavailable) as info:
            client.get_task("t1")
    assert caplog.records  # urllib3 debug lines were captured
    for text in (caplog.text, str(info.value), repr(info.value), repr(client)):
        assert KEY_SECRET not in text
        assert "tok-" not in text


def test_health_reports_refused_credentials_as_an_auth_error() -> None:
    # At start the runner checks health first: bad credentials must not read as "server unhealthy".
    def refuse(req: Seen) -> Answer:
        if req.path == "/api/token":
            return Answer(401, b'{"error": "INVALID_CREDENTIALS"}')
        return Answer(200, b'{"healthy": true}')

    with (
        ScriptedServer(refuse) as srv,
        ConductorClient(srv.url + "/api", auth_key=KEY_ID, auth_secret=KEY_SECRET) as client,
        pytest.raises(ConductorAuthError, match="refused the auth key"),
    ):
        client.health()
