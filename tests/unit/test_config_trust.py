"""The server keys for secrets and private CAs: ``auth_secret_file`` (a private file) and ``ca_bundle``
(SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE in that order, the file's key, --ca-bundle), through
load_config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from leasecore.config.loader import ResolvedConfig, load_config
from leasecore.errors import ConfigError

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
FLAGS = {"task_type": "t", "command": ["/bin/true"]}
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _load(tmp_path: Path, environ: dict[str, str], **overrides: object) -> ResolvedConfig:
    return load_config({**FLAGS, **overrides}, environ, str(tmp_path), hostname="h")


def _pem(path: Path) -> Path:
    path.write_text(PEM)
    return path


def _secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("given", [("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"),
                                   ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"), ("CURL_CA_BUNDLE",)])
def test_ca_variables_are_honoured_in_order(tmp_path: Path, given: tuple[str, ...]) -> None:
    environ = {name: str(_pem(tmp_path / f"{name}.pem")) for name in given}
    server = load_config(FLAGS, environ, str(tmp_path), hostname="h").server
    assert server.ca_bundle == str(tmp_path / f"{given[0]}.pem")
    assert str(server.sources["ca_bundle"]) == f"env {given[0]}"


def test_the_flag_beats_the_environment_and_the_file_is_below_both(tmp_path: Path) -> None:
    flag, env, in_file = (_pem(tmp_path / n) for n in ("flag.pem", "env.pem", "file.pem"))
    config = tmp_path / "c.toml"
    config.write_text('[server]\nca_bundle = "file.pem"\n[[task]]\ntype = "t"\ncommand = ["/bin/true"]\n')
    base = {"config": str(config)}
    assert load_config(base, {}, "/", hostname="h").server.ca_bundle == str(in_file)  # relative to the file
    assert load_config(base, {"CURL_CA_BUNDLE": str(env)}, "/", hostname="h").server.ca_bundle == str(env)
    chosen = load_config({**base, "ca_bundle": str(flag)}, {"SSL_CERT_FILE": str(env)}, "/", hostname="h")
    assert chosen.server.ca_bundle == str(flag)
    assert str(chosen.server.sources["ca_bundle"]) == "flag --ca-bundle"


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "No such file"), ("", "holds no PEM certificate"), ("not a cert\n", "holds no PEM certificate")],
)
def test_a_missing_or_wrong_ca_bundle_is_a_config_error(tmp_path: Path, content: str | None,
                                                        expected: str) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=expected) as info:
        _load(tmp_path, {"REQUESTS_CA_BUNDLE": str(path)})
    assert f"ca_bundle {path} (from env REQUESTS_CA_BUNDLE)" in str(info.value)
    assert info.value.key == "ca_bundle"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_ca_bundle_is_a_config_error(tmp_path: Path) -> None:
    path = _pem(tmp_path / "ca.pem")
    path.chmod(0)
    with pytest.raises(ConfigError, match="Permission denied"):
        _load(tmp_path, {"SSL_CERT_FILE": str(path)})


def test_a_ca_directory_is_accepted(tmp_path: Path) -> None:
    assert _load(tmp_path, {"SSL_CERT_FILE": str(tmp_path)}).server.ca_bundle == str(tmp_path)


def test_the_secret_comes_from_a_private_file_without_its_newline(tmp_path: Path) -> None:
    path = _secret(tmp_path / "secret", "s3cr3t-value\n")
    server = _load(tmp_path, {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET_FILE": str(path)}).server
    assert (server.auth_key, server.auth_secret) == ("k", "s3cr3t-value")
    assert str(server.sources["auth_secret"]) == "env CONDUCTOR_AUTH_SECRET_FILE"
    assert "s3cr3t" not in repr(server)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_secret_file_open_to_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = _secret(tmp_path / "secret", "s3cr3t-value\n", mode)
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET_FILE": str(path)})
    message = str(info.value)
    assert f"auth_secret_file {path} (from env CONDUCTOR_AUTH_SECRET_FILE)" in message
    assert f"mode {mode:04o}" in message and "chmod 600" in message
    assert "s3cr3t" not in message


def test_a_secret_file_in_the_config_file_and_its_problems(tmp_path: Path) -> None:
    _secret(tmp_path / "secret", "from-file")
    config = tmp_path / "c.toml"
    config.write_text('[server]\nauth_key = "k"\nauth_secret_file = "secret"\n')
    server = load_config({**FLAGS, "config": str(config)}, {}, "/", hostname="h").server
    assert server.auth_secret == "from-file"
    _secret(tmp_path / "secret", " \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config({**FLAGS, "config": str(config)}, {}, "/", hostname="h")
    both = load_config({**FLAGS, "config": str(config)}, {"CONDUCTOR_AUTH_SECRET": "x"}, "/", hostname="h")
    assert both.server.auth_secret == "x"  # the value wins over the file (not read), with a warning
    assert any(f"auth_secret_file (from {config}:3 [server]) is ignored" in w for w in both.warnings)
    with pytest.raises(ConfigError, match="No such file"):
        _load(tmp_path, {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET_FILE": str(tmp_path / "none")})


def test_a_secret_file_without_a_key_is_named(tmp_path: Path) -> None:
    path = _secret(tmp_path / "secret", "x")
    with pytest.raises(ConfigError, match=r"auth_secret_file is set .* but auth_key is not"):
        _load(tmp_path, {"CONDUCTOR_AUTH_SECRET_FILE": str(path)})


# --- a config file that holds a credential itself: private, where children run as another user ---

SECRET_TABLES = {
    "auth_secret": '[server]\nauth_key = "k"\nauth_secret = "s3cr3t-in-file"\n',
    "auth_token": '[server]\nauth_token = "s3cr3t-in-file"\n',
    "a password in url": '[server]\nurl = "http://u:s3cr3t-in-file@127.0.0.1:1/api"\n',
}


def _config(tmp_path: Path, text: str, mode: int) -> Path:
    path = tmp_path / "conductor.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("held", sorted(SECRET_TABLES))
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_readable_config_file_with_a_credential_is_refused_under_user(
    tmp_path: Path, held: str, mode: int
) -> None:
    path = _config(tmp_path, SECRET_TABLES[held], mode)
    with pytest.raises(ConfigError) as info:
        load_config({**FLAGS, "config": str(path), "user": "nobody"}, {}, "/", hostname="h")
    message = str(info.value)
    assert f"config file {path} holds {held} and is open to group or others (mode {mode:04o})" in message
    assert "runs its children as user 'nobody' (from flag --user)" in message
    assert f"chmod 600 {path}" in message and "auth_secret_file" in message
    assert "s3cr3t" not in message


@pytest.mark.skipif(os.geteuid() != 0, reason="a user to run children as needs a root runner")
def test_a_user_from_the_file_counts_and_a_private_file_is_fine(tmp_path: Path) -> None:
    text = SECRET_TABLES["auth_secret"] + '[[task]]\ntype = "t"\ncommand = ["/bin/true"]\nuser = "nobody"\n'
    path = _config(tmp_path, text, 0o644)
    with pytest.raises(ConfigError, match=r"as user 'nobody' \(from .*conductor.toml:\d+ \[\[task\]\] 't'\)"):
        load_config({"config": str(path)}, {}, "/", hostname="h")
    path.chmod(0o600)
    assert load_config({"config": str(path)}, {}, "/", hostname="h").server.auth_secret == "s3cr3t-in-file"


def test_without_user_a_readable_config_file_with_a_credential_is_a_warning(tmp_path: Path) -> None:
    path = _config(tmp_path, SECRET_TABLES["auth_token"], 0o644)
    config = load_config({**FLAGS, "config": str(path)}, {}, "/", hostname="h")
    (warning,) = [w for w in config.warnings if "open to group or others" in w]
    assert f"config file {path} holds auth_token" in warning and "any local user can read it" in warning
    assert "s3cr3t" not in warning
    path.chmod(0o600)
    private = load_config({**FLAGS, "config": str(path)}, {}, "/", hostname="h")
    assert not [w for w in private.warnings if "open to group or others" in w]


@pytest.mark.skipif(os.geteuid() != 0, reason="a user to run children as needs a root runner")
def test_a_readable_config_file_without_a_credential_is_fine_under_user(tmp_path: Path) -> None:
    path = _config(tmp_path, '[server]\nauth_key = "k"\nauth_secret_file = "secret"\n', 0o644)
    _secret(tmp_path / "secret", "s3cr3t")
    config = load_config({**FLAGS, "config": str(path), "user": "nobody"}, {}, "/", hostname="h")
    assert config.server.auth_secret == "s3cr3t"
