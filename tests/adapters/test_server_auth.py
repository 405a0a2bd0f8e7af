"""Embedded server, optional Orkes-style token auth (CONDUCTOR_PROTOCOL.md §8); OSS has none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from leasecore.server import EmbeddedServer
from tests.support import wait_until

KEY, SECRET = "key-id", "key-secret"


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(auth_key=KEY, auth_secret=SECRET) as srv:
        yield srv


def _token(srv: EmbeddedServer) -> str:
    r = requests.post(srv.url + "/token", json={"keyId": KEY, "keySecret": SECRET}, timeout=10)
    assert r.status_code == 200, r.text
    token: str = r.json()["token"]
    return token


def test_a_token_from_the_key_and_secret_opens_the_api(server: EmbeddedServer) -> None:
    token = _token(server)
    r = requests.get(
        server.url + "/tasks/poll/batch/x?timeout=0", headers={"X-Authorization": token}, timeout=10
    )
    assert r.status_code == 200
    assert r.json() == []


@pytest.mark.parametrize("headers", [{}, {"X-Authorization": "forged"}], ids=["missing", "wrong"])
def test_missing_or_unknown_token_is_401_invalid_token(
    server: EmbeddedServer, headers: dict[str, str]
) -> None:
    r = requests.get(server.url + "/tasks/poll/batch/x?timeout=0", headers=headers, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"] == "INVALID_TOKEN"


def test_wrong_credentials_get_no_token(server: EmbeddedServer) -> None:
    r = requests.post(server.url + "/token", json={"keyId": KEY, "keySecret": "nope"}, timeout=10)
    assert r.status_code == 401
    assert "token" not in r.json()


def test_expired_tokens_are_401_expired_token_and_a_new_token_works(server: EmbeddedServer) -> None:
    token = _token(server)
    server.expire_tokens()
    r = requests.get(server.url + "/tasks/x", headers={"X-Authorization": token}, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"] == "EXPIRED_TOKEN"
    fresh = _token(server)
    assert (
        requests.get(server.url + "/tasks/x", headers={"X-Authorization": fresh}, timeout=10).status_code
        == 404
    )


def test_tokens_expire_after_their_ttl() -> None:
    with EmbeddedServer(auth_key=KEY, auth_secret=SECRET, token_ttl_seconds=0.3) as srv:
        token = _token(srv)

        def status() -> str | None:
            r = requests.get(srv.url + "/tasks/x", headers={"X-Authorization": token}, timeout=10)
            return r.json().get("error") if r.status_code == 401 else None

        assert wait_until(status, 10, "the token to expire") == "EXPIRED_TOKEN"


def test_both_healths_need_no_token(server: EmbeddedServer) -> None:
    # Health checks come from load balancers, which carry no credentials.
    assert requests.get(server.url.removesuffix("/api") + "/health", timeout=10).status_code == 200
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    assert r.json()["healthy"] is True


def test_key_without_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="both or neither"):
        EmbeddedServer(auth_key=KEY)
