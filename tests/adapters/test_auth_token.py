"""conductor-cli's ``CONDUCTOR_AUTH_TOKEN``: a client given a ready-made token
sends it as is, against the embedded server with auth on; a refused one is an auth error, never a loop of
fetches."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from leasecore.conductor.client import ConductorClient
from leasecore.errors import ConductorAuthError, ConfigError
from leasecore.server import EmbeddedServer

KEY, SECRET = "tok-key", "tok-secret-1"


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(auth_key=KEY, auth_secret=SECRET) as srv:
        yield srv


def test_a_ready_made_token_is_sent_as_given(server: EmbeddedServer) -> None:
    with ConductorClient(server.url, auth_key=KEY, auth_secret=SECRET) as keyed:
        assert keyed.auth is not None
        token = keyed.auth.current(5.0)
    assert token
    with ConductorClient(server.url, auth_token=f" {token}\n") as client:  # as a shell may leave it
        assert client.poll("nothing_here", count=1, timeout_ms=0) == []
        assert client.auth is not None and client.auth.current(5.0) == token
        assert token not in repr(client)


def test_a_refused_token_is_an_auth_error(server: EmbeddedServer) -> None:
    with ConductorClient(server.url, auth_token="not-a-token") as client:
        with pytest.raises(ConductorAuthError) as info:
            client.poll("nothing_here", count=1, timeout_ms=0)
        assert "not-a-token" not in str(info.value)
    with ConductorClient(server.url) as anonymous, pytest.raises(ConductorAuthError):
        anonymous.poll("nothing_here", count=1, timeout_ms=0)


def test_a_token_with_a_line_break_is_refused_before_any_request() -> None:
    with pytest.raises(ConfigError, match="auth_token holds a line break"):
        ConductorClient("http://127.0.0.1:9/api", auth_token="abc\r\nX-Evil: 1")
