"""conductor-cli's configuration as ``worker stdio`` reads it: the profile files, their YAML, and
conductor-cli's order (a flag beats all; below the flags exactly one source: a named file, else the
environment, else the default config.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.workerstdio import merge_environ
from leasecore.config.clifile import CliSettings, profile_path, read_cli_file, resolve_cli
from leasecore.errors import ConfigError

NO_FLAGS: dict[str, str | None] = {}


def home_with(tmp_path: Path, **files: str) -> dict[str, str]:
    directory = tmp_path / ".conductor-cli"
    directory.mkdir(exist_ok=True)
    for name, text in files.items():
        (directory / f"{name}.yaml").write_text(text)
    return {"HOME": str(tmp_path)}


def resolve(tmp_path: Path, environ: dict[str, str], flags: dict[str, str | None] = NO_FLAGS,
            profile: str | None = None, config_file: str | None = None) -> CliSettings:  # fmt: skip
    return resolve_cli(flags, profile=profile, config_file=config_file, environ=environ, cwd=str(tmp_path))


def test_profile_paths_are_conductor_clis() -> None:
    assert profile_path("/h/.conductor-cli", None) == "/h/.conductor-cli/config.yaml"
    assert profile_path("/h/.conductor-cli", "default") == "/h/.conductor-cli/config.yaml"
    assert profile_path("/h/.conductor-cli", "prod") == "/h/.conductor-cli/config-prod.yaml"


def test_a_named_profile_beats_the_environment_and_flags_beat_both(tmp_path: Path) -> None:
    env = home_with(tmp_path, **{"config-prod": "server: http://prod:8080\nauth-key: k1\nauth-secret: s1\n"})
    env |= {"CONDUCTOR_SERVER_URL": "http://env:1/api", "CONDUCTOR_AUTH_TOKEN": "env-token"}
    cli = resolve(tmp_path, env, {"auth-key": "flag-key"}, profile="prod")
    assert cli.active == "file"
    # The environment is not blended in: its token is not used at all (conductor-cli's rule).
    assert dict(cli.values) == {"server": "http://prod:8080", "auth-key": "flag-key", "auth-secret": "s1"}
    assert cli.sources["auth-key"] == "flag --auth-key"
    assert cli.sources["server"] == f"file {tmp_path}/.conductor-cli/config-prod.yaml"


def test_conductor_profile_names_the_profile_and_the_flag_beats_it(tmp_path: Path) -> None:
    env = home_with(tmp_path, **{"config-a": "server: http://a:1\n", "config-b": "server: http://b:1\n"})
    assert resolve(tmp_path, env | {"CONDUCTOR_PROFILE": "a"}).values["server"] == "http://a:1"
    assert resolve(tmp_path, env | {"CONDUCTOR_PROFILE": "a"}, profile="b").values["server"] == "http://b:1"


def test_without_a_named_file_the_environment_wins_over_config_yaml_and_is_never_blended(
    tmp_path: Path,
) -> None:
    env = home_with(tmp_path, config="server: http://default:1\nauth-token: file-token\n")
    cli = resolve(tmp_path, env | {"CONDUCTOR_SERVER_URL": "http://env:2"})
    assert cli.active == "env" and dict(cli.values) == {"server": "http://env:2"}
    cli = resolve(tmp_path, env)  # no variable set: the default file
    assert cli.active == "file"
    assert dict(cli.values) == {"server": "http://default:1", "auth-token": "file-token"}
    assert resolve(tmp_path, env, profile="default").values == cli.values  # "default" is config.yaml


def test_no_file_and_no_environment_is_fine(tmp_path: Path) -> None:
    cli = resolve(tmp_path, {"HOME": str(tmp_path)})
    assert cli.active == "none" and dict(cli.values) == {} and cli.file is None


def test_a_missing_named_profile_is_an_error_naming_the_file(tmp_path: Path) -> None:
    env = home_with(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, env, profile="nope")
    assert str(info.value) == (f"profile 'nope' (from --profile) doesn't exist (expected file: "
                               f"{tmp_path}/.conductor-cli/config-nope.yaml)")  # fmt: skip
    with pytest.raises(ConfigError, match=r"\(from \$CONDUCTOR_PROFILE\)"):
        resolve(tmp_path, env | {"CONDUCTOR_PROFILE": "gone"})
    with pytest.raises(ConfigError, match=r"config file missing\.yaml \(from --config\) not found"):
        resolve(tmp_path, env, config_file="missing.yaml")
    with pytest.raises(ConfigError, match="not a profile name"):
        resolve(tmp_path, env, profile="../etc")


def test_config_names_a_file_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "ci.yaml").write_text("server: http://ci:1\n")
    env = home_with(tmp_path, **{"config-prod": "server: http://prod:1\n"}) | {"CONDUCTOR_PROFILE": "prod"}
    cli = resolve(tmp_path, env | {"CONDUCTOR_SERVER_URL": "http://env:1"}, config_file="ci.yaml")
    assert dict(cli.values) == {"server": "http://ci:1"} and cli.file == f"{tmp_path}/ci.yaml"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server: [unclosed\n", "is not valid YAML at line 2, column 1: expected ',' or ']'"),
        ("server: 'x\n", "is not valid YAML"),
        ("- a\n- b\n", "must hold a YAML mapping (server: ..., auth-key: ...), not a list"),
        ("just text\n", "must hold a YAML mapping (server: ..., auth-key: ...), not str"),
        ("server:\n  url: http://x\n", "server must be a single value (text), not a mapping"),
        ("auth-key: [a, b]\n", "auth-key must be a single value (text), not a list"),
        ("!!python/object:os.system {}\n", "is not valid YAML"),  # safe_load: no objects
    ],
)
def test_a_bad_file_is_an_error_naming_it_never_a_traceback(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config-bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_cli_file(str(path))
    assert str(path) in str(info.value) and message in str(info.value)


def test_other_keys_are_ignored_and_scalars_are_text(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cached-token: abc\ncached-token-expiry: 1700000000\nServer: http://x:1\n"
                    "auth-key: 12345\nauth-secret: ''\nserver-type: OSS\n")  # fmt: skip
    assert read_cli_file(str(path)) == {"server": "http://x:1", "auth-key": "12345", "server-type": "OSS"}
    (tmp_path / "empty.yaml").write_text("")
    assert read_cli_file(str(tmp_path / "empty.yaml")) == {}


def test_the_merge_sees_conductor_clis_choice_in_place_of_the_environment(tmp_path: Path) -> None:
    environ = {"PATH": "/bin", "CONDUCTOR_SERVER_URL": "http://env:1", "CONDUCTOR_AUTH_KEY": "env-key",
               "CONDUCTOR_AUTH_SECRET_FILE": "/run/s"}  # fmt: skip
    from_file = CliSettings(values={"server": "http://file:1", "auth-token": "t"}, active="file")
    merged = merge_environ(environ, from_file)
    assert merged == {"PATH": "/bin", "CONDUCTOR_SERVER_URL": "http://file:1", "CONDUCTOR_AUTH_TOKEN": "t"}
    from_env = CliSettings(values={"server": "http://env:1", "auth-key": "env-key"}, active="env")
    assert merge_environ(environ, from_env) == environ  # the environment is the source: all of it kept
