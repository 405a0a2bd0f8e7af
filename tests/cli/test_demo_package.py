"""The demo's sample files ship inside the package: ``conductor-run demo`` works from an installed wheel.

pyproject.toml maps the repository's top-level ``sample_tasks/`` onto ``leasecore/sample_tasks/`` in
the wheel; ``DemoFiles.locate()`` looks there first, then beside the package (a source checkout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from leasecore.demo import scenes as demo
from leasecore.demo.scenes import DemoFiles, sample_dirs
from leasecore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEMO_FILES = ("demo_long.py", "demo_workflow.json", "demo_taskdefs.json")
# Not part of a build: left out of the copy the wheel is built from.
_NOT_BUILT = {".git", ".venv", "build", "dist", "site", "tests", "bench", "docs", ".hypothesis",
              ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def _setuptools_config() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["setuptools"]
    return config


def test_the_package_list_names_every_package_and_maps_the_sample_tasks() -> None:
    config = _setuptools_config()
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("leasecore", "cli")
        for init in (ROOT / top).rglob("__init__.py")
    }
    # A new subpackage must be listed, or the wheel would silently leave it out.
    assert set(config["packages"]) == on_disk | {"leasecore.sample_tasks"}
    assert config["package-dir"] == {"leasecore.sample_tasks": "sample_tasks"}
    # The one source of the sample files is a plain directory, not an importable package.
    assert all((ROOT / "sample_tasks" / name).is_file() for name in DEMO_FILES)
    assert not (ROOT / "sample_tasks" / "__init__.py").exists()


def test_the_checkout_finds_its_top_level_sample_tasks() -> None:
    dirs = sample_dirs()
    assert dirs[-1] == ROOT / "sample_tasks"
    assert not dirs[0].exists()  # leasecore/sample_tasks/ exists only in a built package
    files = DemoFiles.locate()
    assert files.task_script == ROOT / "sample_tasks" / "demo_long.py"
    assert files.workflow.parent == files.task_defs.parent == ROOT / "sample_tasks"


def _write(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("{}", encoding="utf-8")
    return directory


def test_the_packaged_files_come_first_then_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged, checkout = tmp_path / "packaged", tmp_path / "checkout"
    monkeypatch.setattr(demo, "sample_dirs", lambda: [packaged, checkout])
    _write(checkout, *DEMO_FILES)
    assert DemoFiles.locate().task_script == checkout / "demo_long.py"
    _write(packaged, "demo_long.py")  # incomplete: not used
    assert DemoFiles.locate().task_script == checkout / "demo_long.py"
    _write(packaged, *DEMO_FILES)
    assert DemoFiles.locate().task_script == packaged / "demo_long.py"
    explicit = _write(tmp_path / "explicit", *DEMO_FILES)
    assert DemoFiles.locate(explicit).workflow == explicit / "demo_workflow.json"


def test_missing_everywhere_names_each_place_and_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged, checkout = tmp_path / "packaged", tmp_path / "checkout"
    _write(checkout, "demo_long.py", "demo_taskdefs.json")
    monkeypatch.setattr(demo, "sample_dirs", lambda: [packaged, checkout])
    with pytest.raises(ConfigError) as caught:
        DemoFiles.locate()
    message = str(caught.value)
    assert f"demo_long.py, demo_workflow.json, demo_taskdefs.json in {packaged} or " in message
    assert f"or demo_workflow.json in {checkout}: reinstall conductor-run" in message
    assert caught.value.key == "sample_tasks"


def _copy_for_build(dest: Path) -> Path:
    """The build's inputs, copied: building in /work/main would leave build/ behind (whose stale files
    a later build can pick up) and race with anyone else building there."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == ROOT
        skipped = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
        return skipped | ({n for n in names if n in _NOT_BUILT} if top else set())

    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def _install_into_fresh_venv(wheel: Path, venv: Path) -> Path:
    """A venv that sees the runtime dependencies of .venv but not its editable conductor-run (a .pth
    line only adds a directory: the editable install's own .pth there is not processed), with the
    wheel unpacked into its site-packages as pip would for a pure-Python wheel. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True, timeout=30).stdout.strip())
    import typer  # one of the runtime dependencies: where .venv keeps them

    deps = Path(typer.__file__).resolve().parents[1]
    (site / "deps-from-dotvenv.pth").write_text(f"{deps}\n", encoding="utf-8")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return python


def test_the_demo_runs_from_the_built_wheel_outside_the_checkout(tmp_path: Path) -> None:
    src = _copy_for_build(tmp_path / "src")
    out = tmp_path / "wheelhouse"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = out.glob("conductor_run-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    prefix = "leasecore/sample_tasks/"
    shipped = {n.removeprefix(prefix) for n in names if n.startswith(prefix)}
    assert shipped == {p.name for p in (ROOT / "sample_tasks").iterdir() if p.is_file()}
    assert {"leasecore/demo/scenes.py", "leasecore/py.typed", "cli/main.py",
            "leasecore/server/embedded.py"} <= names
    assert not [n for n in names if "__pycache__" in n or n.startswith("sample_tasks/")]

    python = _install_into_fresh_venv(wheel, tmp_path / "venv")
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("CONDUCTOR", "PYTHON"))}
    probe = subprocess.run(
        [str(python), "-c",
         "import json, sys, cli.main, leasecore.demo.scenes as d\n"
         "script = str(d.DemoFiles.locate().task_script)\n"
         "print(json.dumps([cli.main.__file__, d.__file__, script, sys.path]))"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert probe.returncode == 0, probe.stderr
    cli_main, demo_module, task_script, path = json.loads(probe.stdout)
    assert cli_main == str(site / "cli" / "main.py")
    assert demo_module == str(site / "leasecore" / "demo" / "scenes.py")
    assert task_script == str(site / "leasecore" / "sample_tasks" / "demo_long.py")
    assert not [p for p in path if p.startswith(str(ROOT)) and not p.startswith(str(ROOT / ".venv"))]

    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [str(python), "-m", "cli", "demo", "--plain", "--keep-files"],
        cwd=elsewhere, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "All 3 scenes showed what they claim." in proc.stdout
    kept = re.search(r"scene files kept in (\S+)", proc.stderr)
    assert kept, proc.stderr
    configs = sorted(Path(kept.group(1)).glob("*/conductor.toml"))
    assert len(configs) == 3
    for config in configs:
        with open(config, "rb") as f:
            [task] = tomllib.load(f)["task"]
        assert task["command"] == [str(python), task_script]  # the runner ran the packaged sample task
