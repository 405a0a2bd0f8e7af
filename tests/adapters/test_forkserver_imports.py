"""The fork server loads nothing of the runner's side: booted as the Supervisor boots it (``-I -S``, an
empty environment, stubs for ``leasecore`` and ``leasecore.process``), it imports only its own room
(``process/forkserver/``) and, of the Linux layer, ``procfs`` and ``cgroupfs``. It lives as long as the
runner and its memory counts in the runner's footprint; a module of the runner's side imported by one
of its modules (or by a package ``__init__.py`` it runs) would be loaded into it for nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import leasecore
from leasecore.process.supervisor.forkserver_link import FORKSERVER_BOOT

ROOT = Path(leasecore.__file__).resolve().parent.parent
MAIN = "main(sys.argv[2:])\n"
# The packages it passes through (stubs or docstring-only __init__ files), its room, and the two
# stdlib-only modules of the Linux layer it uses.
MAY_LOAD = ("leasecore", "leasecore.process", "leasecore.process.forkserver", "leasecore.process.linux",
            "leasecore.process.linux.procfs", "leasecore.process.linux.cgroupfs")


def loaded_by_boot(extra: str = "") -> list[str]:
    """The project's modules loaded once the boot script has imported ``main`` (and run ``extra``)."""
    assert FORKSERVER_BOOT.endswith(MAIN)
    probe = FORKSERVER_BOOT[: -len(MAIN)] + extra + "import json\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe, str(ROOT), "-1"], env={},
                          capture_output=True, text=True, timeout=60, check=True)
    return [name for name in json.loads(done.stdout) if name.split(".")[0] == "leasecore"]


def runner_side(loaded: list[str]) -> list[str]:
    return [name for name in loaded
            if name not in MAY_LOAD and not name.startswith("leasecore.process.forkserver.")]


def test_the_fork_server_loads_only_its_own_room_and_two_stdlib_modules_of_the_linux_layer() -> None:
    loaded = loaded_by_boot()
    assert "leasecore.process.forkserver.server" in loaded  # the probe saw the real boot
    assert runner_side(loaded) == []


def test_a_runner_side_module_in_the_fork_server_is_caught() -> None:
    loaded = loaded_by_boot("import leasecore.process.linux.cgroups\n")
    assert "leasecore.process.linux.cgroups" in runner_side(loaded)
    assert "leasecore.errors" in runner_side(loaded)  # cgroups' own imports come along
