"""Configuration of the conductor-cli drop-in: the ``protocol`` key, and conductor-cli's
``CONDUCTOR_AUTH_TOKEN`` accepted as ``[server] auth_token``."""

from __future__ import annotations

from typing import Any

import pytest

from leasecore.config.loader import ResolvedConfig, parse_toml, resolve
from leasecore.errors import ConfigError
from leasecore.runner.plans import plan_for

BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


def _resolve(text: str = BASE, environ: dict[str, str] | None = None, **overrides: Any) -> ResolvedConfig:
    return resolve(parse_toml(text, "conductor.toml"), environ or {}, overrides, cwd="/work", hostname="h")


def test_protocol_defaults_to_native() -> None:
    task = _resolve().tasks[0]
    assert task.protocol == "native"
    assert str(task.sources["protocol"]) == "default"
    assert plan_for(task).spec.protocol == "native"


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "source"),
    [
        (BASE + 'protocol = "stdio"\n', {}, {}, "conductor.toml:4 [[task]] 'encode'"),
        ('[worker]\nprotocol = "stdio"\n' + BASE, {}, {}, "conductor.toml:2 [worker]"),
        (BASE, {"CONDUCTOR_WORKER_ALL_PROTOCOL": "stdio"}, {}, "env CONDUCTOR_WORKER_ALL_PROTOCOL (global)"),
        (BASE, {"conductor_worker_encode_protocol": "stdio"}, {}, "env conductor_worker_encode_protocol"),
        (BASE + 'protocol = "native"\n', {}, {"protocol": "stdio"}, "flag --protocol"),
    ],
)
def test_protocol_from_every_layer(text: str, environ: dict[str, str], overrides: dict[str, Any],
                                   source: str) -> None:  # fmt: skip
    task = _resolve(text, environ, **overrides).tasks[0]
    assert task.protocol == "stdio"
    assert str(task.sources["protocol"]).startswith(source)
    assert plan_for(task).spec.protocol == "stdio"


def test_a_bad_protocol_names_the_key_its_source_and_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(BASE + 'protocol = "json"\n')
    assert str(info.value) == (
        "invalid protocol = 'json' (from conductor.toml:4 [[task]] 'encode'): expected 'native' or 'stdio'"
    )
    with pytest.raises(ConfigError, match="from flag --protocol"):
        _resolve(protocol="STDIO")


def test_conductor_clis_token_variable_is_read_and_masked() -> None:
    server = _resolve(environ={"CONDUCTOR_AUTH_TOKEN": "tok-123"}).server
    assert server.auth_token == "tok-123"
    assert str(server.sources["auth_token"]) == "env CONDUCTOR_AUTH_TOKEN"
    assert "tok-123" not in repr(server)


def test_with_a_key_and_secret_too_the_token_is_left_unused_with_a_warning() -> None:
    env = {"CONDUCTOR_AUTH_TOKEN": "tok-123", "CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET": "s"}
    config = _resolve(environ=env)
    assert config.server.auth_token is None and config.server.auth_key == "k"
    (warning,) = [w for w in config.warnings if "auth_token" in w]
    assert warning == ("auth_token (from env CONDUCTOR_AUTH_TOKEN) is not used: auth_key and auth_secret "
                       "(from env CONDUCTOR_AUTH_KEY) are set too, and their token is refreshed")  # fmt: skip
    assert "tok-123" not in warning


def test_a_token_in_the_file_is_allowed_with_a_warning() -> None:
    config = _resolve('[server]\nauth_token = "tok-123"\n' + BASE)
    assert config.server.auth_token == "tok-123"
    assert any("CONDUCTOR_AUTH_TOKEN" in warning for warning in config.warnings)
