"""deploy/Containerfile, parsed: no image builder runs here (a docker client without an engine, no
registry to pull a base image from), so the build itself is not tested; what it relies on is."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def all_of(name: str) -> list[str]:
    return [args for word, args in instructions() if word == name]


def test_a_small_python_base() -> None:
    (arg,) = [a for a in all_of("ARG") if a.startswith("PYTHON_IMAGE=")]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.(1[1-9])-slim(-\w+)?", image), image
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"  # the base's Python satisfies it
    assert all_of("FROM") == ["${PYTHON_IMAGE}"]


def test_the_package_comes_from_its_wheel_and_the_entry_point_is_conductor_run() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wheel_glob = "conductor_run-*.whl"  # a wheel's file name: the project name with - as _
    assert project["name"].replace("-", "_") + "-*.whl" == wheel_glob
    assert any(f"dist/{wheel_glob}" in args for args in all_of("COPY"))
    assert any("pip install" in args and wheel_glob in args for args in all_of("RUN"))
    assert project["scripts"]["conductor-run"] == "cli.main:main"
    (entrypoint,) = all_of("ENTRYPOINT")
    # Exec form (no shell in between that would swallow SIGTERM), tini as PID 1 in front.
    assert json.loads(entrypoint) == ["/usr/bin/tini", "--", "conductor-run"]
    assert any("apt-get install" in args and "tini" in args for args in all_of("RUN"))
    (cmd,) = all_of("CMD")
    assert json.loads(cmd)[0] == "run"


def test_it_runs_as_a_non_root_user_and_stops_on_sigterm() -> None:
    users = all_of("USER")
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric: Kubernetes' runAsNonRoot can only check a numeric user.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert any(f"--uid {uid}" in args for args in all_of("RUN"))
    assert all_of("STOPSIGNAL") == ["SIGTERM"]
    env = " ".join(all_of("ENV"))
    assert "CONDUCTOR_RUN_STATE_DIR=/var/lib/conductor-run" in env
    assert any(f"-o {uid}" in args and "/var/lib/conductor-run" in args for args in all_of("RUN"))
