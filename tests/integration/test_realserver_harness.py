"""The real-server harness itself (tests/realserver.py), with fake `mvn` and `java` executables.

These run everywhere (no Java, no jar, no network): they pin down the parts of the harness whose
failure would otherwise only show up on a fresh CI machine: the atomic jar download, the Java
search, clear failures, and the TERM -> KILL stop.
"""

from __future__ import annotations

import os
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.realserver import (
    RealConductorServer,
    RealServerUnavailable,
    ensure_jar,
    find_java,
    jar_path,
    java_major_version,
    process_group_alive,
)
from tests.support import wait_until

VERSION = "9.9.9"


def write_exe(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def make_boot_jar(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nStart-Class: x.Main\n")
        zf.writestr("BOOT-INF/classes/application.properties", "")


FAKE_MVN = """
import sys, zipfile
from pathlib import Path
args = sys.argv[1:]
out = Path(next(a for a in args if a.startswith("-DoutputDirectory=")).split("=", 1)[1])
artifact = next(a for a in args if a.startswith("-Dartifact=")).split("=", 1)[1]
version = artifact.split(":")[2]
Path(sys.argv[0] + ".args").write_text(" ".join(args))
jar = out / f"conductor-server-{version}-boot.jar"
MODE
"""


def fake_mvn(tmp_path: Path, mode: str) -> Path:
    return write_exe(tmp_path / "mvn", FAKE_MVN.replace("MODE", mode))


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(".download-"))


def test_cached_jar_is_returned_without_maven(tmp_path: Path) -> None:
    target = jar_path(VERSION, cache_dir=tmp_path)
    target.parent.mkdir(parents=True)
    make_boot_jar(target)
    assert ensure_jar(VERSION, cache_dir=tmp_path, mvn=str(tmp_path / "no-such-mvn")) == target


def test_download_lands_atomically_in_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    mvn = fake_mvn(tmp_path, (
        "with zipfile.ZipFile(jar, 'w') as zf:\n"
        "    zf.writestr('META-INF/MANIFEST.MF', 'Start-Class: x.Main\\n')\n"
    ))
    got = ensure_jar(VERSION, cache_dir=cache, mvn=str(mvn))
    assert got == cache / f"jar-{VERSION}" / f"conductor-server-{VERSION}-boot.jar"
    assert zipfile.is_zipfile(got)
    args = (tmp_path / "mvn.args").read_text()
    assert f"-Dartifact=org.conductoross:conductor-server:{VERSION}:jar:boot" in args
    assert leftovers(cache) == []


def test_failed_download_leaves_no_jar(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    mvn = fake_mvn(tmp_path, (
        "jar.write_bytes(b'PK\\x03\\x04 truncated')\n"
        "print('[ERROR] Could not transfer artifact: connection reset', file=sys.stderr)\n"
        "sys.exit(1)\n"
    ))
    with pytest.raises(RealServerUnavailable, match="connection reset") as info:
        ensure_jar(VERSION, cache_dir=cache, mvn=str(mvn))
    assert "exit 1" in str(info.value)
    assert not jar_path(VERSION, cache_dir=cache).exists()
    assert leftovers(cache) == []


def test_a_download_that_is_not_a_jar_is_rejected(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    mvn = fake_mvn(tmp_path, "jar.write_bytes(b'<html>proxy login</html>')\n")
    with pytest.raises(RealServerUnavailable, match="not a boot jar"):
        ensure_jar(VERSION, cache_dir=cache, mvn=str(mvn))
    assert not jar_path(VERSION, cache_dir=cache).exists()
    assert leftovers(cache) == []


def test_missing_maven_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RealServerUnavailable, match=r"Maven .* is not on PATH"):
        ensure_jar(VERSION, cache_dir=tmp_path, mvn=str(tmp_path / "no-such-mvn"))


def fake_java(directory: Path, version_line: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_exe(directory / "java", f"import sys\nprint({version_line!r}, file=sys.stderr)\n")


@pytest.mark.parametrize(
    ("line", "major"),
    [
        ('openjdk version "25.0.1" 2025-10-21 LTS', 25),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "17.0.15" 2025-04-15', 17),
    ],
)
def test_java_major_version(tmp_path: Path, line: str, major: int) -> None:
    assert java_major_version(str(fake_java(tmp_path, line))) == major


def test_find_java_skips_old_javas(tmp_path: Path) -> None:
    old_home = tmp_path / "jdk17"
    fake_java(old_home / "bin", 'openjdk version "17.0.15"')
    jvm_root = tmp_path / "jvm"
    new = fake_java(jvm_root / "temurin-21-jdk" / "bin", 'openjdk version "21.0.4"')
    fake_java(jvm_root / "java-11-openjdk" / "bin", 'openjdk version "11.0.2"')
    environ = {"JAVA_HOME": str(old_home), "PATH": str(old_home / "bin")}
    assert find_java(environ=environ, jvm_root=jvm_root) == str(new)


def test_explicit_java_must_be_new_enough(tmp_path: Path) -> None:
    old = fake_java(tmp_path / "bin", 'openjdk version "17.0.15"')
    with pytest.raises(RealServerUnavailable, match=r"CONDUCTOR_RUN_JAVA.*Java 17.*needs Java 21\+"):
        find_java(environ={"CONDUCTOR_RUN_JAVA": str(old)}, jvm_root=tmp_path / "none")
    # A JDK home is accepted too.
    good = fake_java(tmp_path / "jdk" / "bin", 'openjdk version "25"')
    environ = {"CONDUCTOR_RUN_JAVA": str(tmp_path / "jdk")}
    assert find_java(environ=environ, jvm_root=tmp_path / "none") == str(good)


def test_no_suitable_java_fails_with_what_was_tried(tmp_path: Path) -> None:
    old = fake_java(tmp_path / "bin", 'openjdk version "17.0.15"')
    with pytest.raises(RealServerUnavailable, match=r"needs Java 21\+; tried: .*Java 17") as info:
        find_java(environ={"PATH": str(old.parent)}, jvm_root=tmp_path / "none")
    assert "CONDUCTOR_RUN_JAVA" in str(info.value)


# Fake `java`: reads the properties file the harness wrote, then behaves as MODE says.
FAKE_SERVER = """
import http.server, signal, sys, time
from pathlib import Path
arg = next(a for a in sys.argv if a.startswith("--spring.config.additional-location=file:"))
props = dict(line.split("=", 1) for line in Path(arg.split("file:", 1)[1]).read_text().splitlines())
print("fake server starting", flush=True)
MODE
"""

SERVE = """
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"healthy":true}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
http.server.HTTPServer((props["server.address"], int(props["server.port"])), H).serve_forever()
"""


def fake_server(tmp_path: Path, mode: str) -> str:
    return str(write_exe(tmp_path / "java", FAKE_SERVER.replace("MODE", mode)))


def test_start_waits_for_health_and_stop_terms(tmp_path: Path) -> None:
    import requests

    server = RealConductorServer(tmp_path / "x.jar", fake_server(tmp_path, SERVE))
    with server:
        assert server.url == f"http://127.0.0.1:{server.port}/api"
        with requests.Session() as http:
            assert http.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert server.startup_seconds is not None
        workdir = server.workdir
        assert workdir is not None
        props = (workdir / "test.properties").read_text()
        assert "server.address=127.0.0.1\n" in props
        assert f"jdbc:sqlite:{workdir}/conductor.db" in props
        pid = server.pid
    assert pid is not None and not process_group_alive(pid)
    assert not workdir.exists()


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path: Path) -> None:
    java = fake_server(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n")
    server = RealConductorServer(tmp_path / "x.jar", java, stop_grace_seconds=1.0)
    server.launch()
    pid = server.pid
    assert pid is not None
    # TERM is ignored from here on
    wait_until(lambda: "fake server starting" in server.log_tail(), 30, "the fake server to start")
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 15
    assert not process_group_alive(pid)


def test_a_server_that_dies_fails_start_with_its_log(tmp_path: Path) -> None:
    java = fake_server(tmp_path, "print('APPLICATION FAILED TO START: boom', flush=True)\nsys.exit(3)\n")
    server = RealConductorServer(tmp_path / "x.jar", java)
    with pytest.raises(RealServerUnavailable, match="exited with code 3") as info:
        server.start()
    assert "APPLICATION FAILED TO START: boom" in str(info.value)
    assert server.workdir is not None and (server.workdir / "server.log").exists()  # kept for a post-mortem
    server.keep_dir = False
    server.stop()


def test_a_server_that_never_gets_healthy_is_stopped(tmp_path: Path) -> None:
    java = fake_server(tmp_path, "time.sleep(600)\n")
    server = RealConductorServer(tmp_path / "x.jar", java, health_timeout_seconds=1.0)
    with pytest.raises(RealServerUnavailable, match="not healthy within 1 s") as info:
        server.start()
    assert "fake server starting" in str(info.value)
    assert server.pid is not None and not process_group_alive(server.pid)
    server.keep_dir = False
    server.stop()


def test_server_environment_carries_no_conductor_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.realserver as realserver

    monkeypatch.setitem(realserver._ENVIRON_AT_IMPORT, "CONDUCTOR_AUTH_SECRET", "s3cret")
    monkeypatch.setitem(realserver._ENVIRON_AT_IMPORT, "SPRING_DATASOURCE_URL", "jdbc:bad")
    dump = tmp_path / "env.txt"
    java = fake_server(tmp_path, f"import os\nPath({str(dump)!r}).write_text(repr(sorted(os.environ)))\n")
    server = RealConductorServer(tmp_path / "x.jar", java)
    server.launch()
    wait_until(lambda: dump.exists() and dump.read_text(), 30, "the fake server to dump its environment")
    server.stop()
    names = dump.read_text()
    assert "CONDUCTOR_AUTH_SECRET" not in names
    assert "SPRING_DATASOURCE_URL" not in names
    assert os.environ.get("PATH") is None or "'PATH'" in names
