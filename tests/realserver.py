"""The real Conductor OSS server (boot jar from Maven Central) for tests marked ``real_server``.

Loaded as a pytest plugin (``pytest_plugins`` in ``tests/conftest.py``). It provides:

- :data:`CONDUCTOR_VERSION`: the pinned server version;
- :func:`ensure_jar`: the cached boot jar, downloaded with Maven into a cache outside the repository
  (``$CONDUCTOR_RUN_JAR_CACHE``, default ``~/.cache/conductor-run``) when missing, atomically;
- :func:`find_java`: a Java >= 21 (``$CONDUCTOR_RUN_JAVA``, ``$JAVA_HOME``, ``/usr/lib/jvm/*``, ``PATH``);
- :class:`RealConductorServer`: one server on a free loopback port with a fresh SQLite database,
  always stopped (TERM, then KILL), and killed by the kernel if the test process itself dies;
- the session fixtures ``real_server`` and ``real_server_url`` (``"http://127.0.0.1:PORT/api"``),
  started once per session and only when a test asks for them. When Java 21+ or the jar cannot be had
  they fail with a clear message: these tests are part of CI and must not skip silently.

``python -m tests.realserver fetch`` downloads the jar ahead of a test run (``scripts/test`` does that,
so a slow download does not count against the first test's timeout).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import requests

CONDUCTOR_VERSION = "3.32.1"
"""The Conductor OSS server version the suite is pinned to."""

MIN_JAVA_MAJOR = 21
"""3.22+ jars are Java 21 bytecode."""

ARTIFACT = "org.conductoross:conductor-server:{version}:jar:boot"
HEALTH_TIMEOUT_SECONDS = 180.0
STOP_GRACE_SECONDS = 30.0
KILL_WAIT_SECONDS = 10.0
MAVEN_TIMEOUT_SECONDS = 1800.0
JVM_ROOT = Path("/usr/lib/jvm")

# The environment as it was when pytest loaded this plugin: the autouse ``clean_environ`` fixture
# removes CONDUCTOR_* variables around each test, but the jar cache and the Java choice are the
# developer's settings for the whole session.
_ENVIRON_AT_IMPORT: dict[str, str] = dict(os.environ)

# The only variables the JVM inherits. Anything else (CONDUCTOR_*, SPRING_*, JAVA_TOOL_OPTIONS,
# credentials) could change the server's configuration through Spring's relaxed binding, or leak.
_JVM_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER")

# The session server's one addition to that environment: a fixed test secret and a test environment
# value, which the server resolves into a polled task's runtimeMetadata when its task definition
# declares their names (docs/secrets.md; tests/integration/test_secrets_real_server.py). Nothing
# else reads them, and they are not credentials of anything.
TEST_SECRET_NAME = "CR_TEST_SECRET"
TEST_SECRET_VALUE = "cr-test-secret-4f1d9a7c"
TEST_ENV_NAME = "CR_TEST_ENV"
TEST_ENV_VALUE = "cr-test-env-b83e"
SESSION_SERVER_ENV = {
    f"CONDUCTOR_SECRET_{TEST_SECRET_NAME}": TEST_SECRET_VALUE,
    f"CONDUCTOR_ENV_{TEST_SECRET_NAME}": "cr-test-env-value-that-loses",  # a secret wins over it
    f"CONDUCTOR_ENV_{TEST_ENV_NAME}": TEST_ENV_VALUE,
}


class RealServerUnavailable(Exception):
    """The real server cannot be had here: no Java 21+, no jar, or it failed to start."""


# -- the jar -------------------------------------------------------------------------------------


def jar_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = _ENVIRON_AT_IMPORT if environ is None else environ
    configured = env.get("CONDUCTOR_RUN_JAR_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(env.get("HOME") or Path.home()).expanduser() / ".cache" / "conductor-run"


def jar_path(version: str = CONDUCTOR_VERSION, *, cache_dir: Path | None = None) -> Path:
    base = jar_cache_dir() if cache_dir is None else cache_dir
    return base / f"jar-{version}" / f"conductor-server-{version}-boot.jar"


def _is_boot_jar(path: Path) -> bool:
    """A complete Spring Boot jar: the zip central directory (at the end) reads, with a Boot manifest."""
    try:
        with zipfile.ZipFile(path) as zf:
            manifest = zf.read("META-INF/MANIFEST.MF").decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile, KeyError):
        return False
    return "Start-Class:" in manifest


def ensure_jar(
    version: str = CONDUCTOR_VERSION,
    *,
    cache_dir: Path | None = None,
    mvn: str = "mvn",
    timeout_seconds: float = MAVEN_TIMEOUT_SECONDS,
) -> Path:
    """Return the cached boot jar, downloading it with Maven first if it is missing.

    The download goes to a temporary directory inside the cache and is renamed into place only once
    it is a complete jar, so an interrupted download never leaves a broken jar behind. A lock file
    keeps two concurrent test runs from downloading it twice.
    """
    target = jar_path(version, cache_dir=cache_dir)
    if target.is_file():
        return target
    base = target.parent.parent
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RealServerUnavailable(f"cannot create the jar cache {base}: {exc}") from exc
    with open(base / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another run downloaded it while we waited
            return target
        mvn_path = shutil.which(mvn)
        if mvn_path is None:
            raise RealServerUnavailable(
                f"the Conductor server jar is not cached at {target} and Maven ({mvn!r}) is not on PATH "
                "to download it; install Maven, or put the jar there by hand"
            )
        artifact = ARTIFACT.format(version=version)
        with tempfile.TemporaryDirectory(dir=base, prefix=".download-") as tmp:
            cmd = [mvn_path, "-q", "-B", "dependency:copy", f"-Dartifact={artifact}",
                   f"-DoutputDirectory={tmp}"]
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=timeout_seconds, check=False,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired as exc:
                raise RealServerUnavailable(
                    f"downloading {artifact} with Maven took longer than {timeout_seconds:.0f} s"
                ) from exc
            downloaded = Path(tmp) / target.name
            if proc.returncode != 0 or not downloaded.is_file():
                tail = _tail(proc.stdout + proc.stderr, 30)
                raise RealServerUnavailable(
                    f"could not download {artifact} with Maven (exit {proc.returncode}):\n{tail}"
                )
            if not _is_boot_jar(downloaded):
                raise RealServerUnavailable(f"Maven produced {downloaded.name}, but it is not a boot jar")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(downloaded, target)
    return target


# -- Java --------------------------------------------------------------------------------------------

_VERSION_RE = re.compile(r'version "(\d+)(?:\.(\d+))?')


def java_major_version(java: str, *, timeout_seconds: float = 30.0) -> int | None:
    """The major version ``java -version`` reports (8 for "1.8.0_x"), or None if it does not run."""
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=timeout_seconds, check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION_RE.search(proc.stderr + proc.stdout)
    if proc.returncode != 0 or match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        major = int(match.group(2))
    return major


def _java_in(home: str) -> str:
    return str(Path(home) / "bin" / "java")


def _leading_number(name: str) -> int:
    match = re.search(r"\d+", name)
    return 0 if match is None else int(match.group())


def java_candidates(
    environ: Mapping[str, str] | None = None, *, jvm_root: Path = JVM_ROOT
) -> list[tuple[str, str]]:
    """(java binary, where it came from), in the order they are tried."""
    env = _ENVIRON_AT_IMPORT if environ is None else environ
    found: list[tuple[str, str]] = []
    if env.get("JAVA_HOME"):
        found.append((_java_in(env["JAVA_HOME"]), "$JAVA_HOME"))
    if jvm_root.is_dir():
        # Newest-looking first (by the first number in the name); real versions are checked anyway.
        homes = sorted(jvm_root.iterdir(), key=lambda p: _leading_number(p.name), reverse=True)
        found.extend((_java_in(str(home)), str(jvm_root)) for home in homes if not home.is_symlink())
    on_path = shutil.which("java", path=env.get("PATH"))
    if on_path:
        found.append((on_path, "PATH"))
    unique: list[tuple[str, str]] = []
    for java, source in found:
        if Path(java).is_file() and all(java != seen for seen, _ in unique):
            unique.append((java, source))
    return unique


def find_java(
    min_major: int = MIN_JAVA_MAJOR, environ: Mapping[str, str] | None = None, *, jvm_root: Path = JVM_ROOT
) -> str:
    """Path of a ``java`` whose major version is at least ``min_major``.

    ``$CONDUCTOR_RUN_JAVA`` (a java binary or a JDK home) wins and must be suitable; otherwise the first
    suitable one of ``$JAVA_HOME``, ``/usr/lib/jvm/*`` (newest first) and ``PATH``.
    """
    env = _ENVIRON_AT_IMPORT if environ is None else environ
    explicit = env.get("CONDUCTOR_RUN_JAVA")
    if explicit:
        java = _java_in(explicit) if Path(explicit).is_dir() else explicit
        major = java_major_version(java)
        if major is None or major < min_major:
            what = "not a working java" if major is None else f"Java {major}"
            raise RealServerUnavailable(
                f"$CONDUCTOR_RUN_JAVA={explicit!r} is {what}; "
                f"the Conductor {CONDUCTOR_VERSION} server needs Java {min_major}+"
            )
        return java
    rejected: list[str] = []
    for java, source in java_candidates(env, jvm_root=jvm_root):
        major = java_major_version(java)
        if major is not None and major >= min_major:
            return java
        rejected.append(f"{java} ({source}): {'does not run' if major is None else f'Java {major}'}")
    tried = "; ".join(rejected) or "no java found"
    raise RealServerUnavailable(
        f"the Conductor {CONDUCTOR_VERSION} server needs Java {min_major}+; tried: {tried}. "
        "Install a JDK 21+ or point $CONDUCTOR_RUN_JAVA at one"
    )


# -- the server --------------------------------------------------------------------------------------

# Started instead of java: makes the kernel SIGKILL the JVM when the process that started it dies
# (even by SIGKILL), then execs java. Safe because this launcher is single-threaded. The parent-pid
# check closes the race where the parent died before prctl ran. Note: the parent-death signal fires
# when the *thread* that spawned the launcher exits, so start servers from a long-lived thread.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "if libc.prctl(1,int(signal.SIGKILL),0,0,0)!=0:\n"  # 1 = PR_SET_PDEATHSIG
    "    raise OSError(ctypes.get_errno(),'prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid()!=int(sys.argv[1]):\n"
    "    os._exit(70)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)

_LIVE: set[RealConductorServer] = set()
_LIVE_LOCK = threading.Lock()


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def server_properties(port: int, db_path: Path) -> dict[str, str]:
    """The test configuration (CONDUCTOR_PROTOCOL.md §13), on top of the jar's application.properties."""
    return {
        "server.port": str(port),
        "server.address": "127.0.0.1",
        "spring.datasource.url": f"jdbc:sqlite:{db_path}?busy_timeout=15000&journal_mode=WAL",
        "conductor.db.type": "sqlite",
        "conductor.queue.type": "sqlite",
        "conductor.indexing.enabled": "true",
        "conductor.indexing.type": "sqlite",
        "conductor.workflow-execution-lock.type": "local_only",
        "conductor.app.ownerEmailMandatory": "false",
        "conductor.app.workflow.name-validation.enabled": "false",
        "conductor.app.workflowOffsetTimeout": "5",
        "conductor.app.taskExecutionPostponeDuration": "5",
        "conductor.scheduler.enabled": "false",
        # Stops the AI task workers; the AI model providers still initialise (and log errors about
        # missing API keys) at startup: harmless.
        "conductor.integrations.ai.enabled": "false",
        "conductor.metrics-prometheus.enabled": "false",
    }


class RealConductorServer:
    """One real Conductor server process, on a free loopback port, with its own temporary directory.

    ``start()`` returns once ``GET /health`` answers 200; ``stop()`` sends SIGTERM to its process group,
    then SIGKILL after ``stop_grace_seconds``. Also stopped at interpreter exit, and killed by the kernel
    if the process that started it dies.
    """

    def __init__(
        self,
        jar: Path,
        java: str,
        *,
        health_timeout_seconds: float = HEALTH_TIMEOUT_SECONDS,
        stop_grace_seconds: float = STOP_GRACE_SECONDS,
        extra_properties: Mapping[str, str] | None = None,
        keep_dir: bool = False,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        """``extra_env``: variables added to the JVM's otherwise minimal environment."""
        self.jar = jar
        self.extra_env = dict(extra_env or {})
        self.java = java
        self.health_timeout_seconds = health_timeout_seconds
        self.stop_grace_seconds = stop_grace_seconds
        self.extra_properties = dict(extra_properties or {})
        self.keep_dir = keep_dir
        self.workdir: Path | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._launched_at = 0.0

    # -- public values

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The API base, as clients take it: ``http://127.0.0.1:PORT/api``."""
        return f"{self.base_url}/api"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def log_path(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("server not started")
        return self.workdir / "server.log"

    def log_tail(self, lines: int = 60) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except (OSError, RuntimeError):
            return "(no server log)"

    def rss_bytes(self) -> int | None:
        """Resident set size of the JVM, from /proc (None when not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return None if match is None else int(match.group(1)) * 1024

    # -- lifecycle

    def __enter__(self) -> RealConductorServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, *, port_attempts: int = 3) -> None:
        """Launch the server and wait until it is healthy; raises :class:`RealServerUnavailable`."""
        for attempt in range(1, port_attempts + 1):
            self.launch()
            try:
                self.wait_healthy()
                return
            except _PortTaken:
                self.stop(graceful=False)
                self.proc = None
                if attempt == port_attempts:
                    raise RealServerUnavailable(
                        f"the Conductor server could not bind a free port in {port_attempts} attempts"
                    ) from None
            except BaseException as exc:
                # The log stays for a post-mortem; its path is in the message.
                self.keep_dir = self.keep_dir or isinstance(exc, RealServerUnavailable)
                # A JVM still booting defers SIGTERM until Spring has started (~20-40 s); its fresh
                # database holds nothing worth a clean shutdown.
                self.stop(graceful=False)
                raise

    def launch(self) -> None:
        """Start the JVM (through the parent-death launcher) without waiting for it to be healthy."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.workdir = Path(tempfile.mkdtemp(prefix="conductor-real-server-"))
        (self.workdir / "tmp").mkdir()
        self.port = _free_loopback_port()
        props = server_properties(self.port, self.workdir / "conductor.db")
        props.update(self.extra_properties)
        props_file = self.workdir / "test.properties"
        props_file.write_text("".join(f"{key}={value}\n" for key, value in props.items()))
        argv = [
            self.java,
            "-Xmx1g",
            "-XX:+UseSerialGC",          # fewer GC threads on a shared 2-core machine
            "-XX:TieredStopAtLevel=1",   # C1 only: faster startup, plenty for tests
            "--enable-native-access=ALL-UNNAMED",  # sqlite-jdbc's JNI, quiet on Java 24+
            f"-Djava.io.tmpdir={self.workdir / 'tmp'}",  # sqlite/tomcat scratch files die with the dir
            "-jar", str(self.jar),
            f"--spring.config.additional-location=file:{props_file}",
        ]
        env = {key: _ENVIRON_AT_IMPORT[key] for key in _JVM_ENV_KEEP if key in _ENVIRON_AT_IMPORT}
        env.update(self.extra_env)
        self._launched_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _LAUNCHER, str(os.getpid()), *argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir, env=env, start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE.add(self)

    def wait_healthy(self) -> None:
        """Wait for ``GET /health`` = 200, bounded; fail with the log's tail if the server dies first."""
        if self.proc is None:
            raise RuntimeError("server not launched")
        deadline = self._launched_at + self.health_timeout_seconds
        session = requests.Session()
        try:
            while True:
                code = self.proc.poll()
                if code is not None:
                    log = self.log_tail()
                    if "already in use" in log or "Address already in use" in log:
                        raise _PortTaken()
                    raise RealServerUnavailable(
                        f"the Conductor server exited with code {code} before it was healthy; "
                        f"log {self.log_path}, last lines:\n{log}"
                    )
                with contextlib.suppress(requests.RequestException):
                    if session.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                        self.startup_seconds = time.monotonic() - self._launched_at
                        return
                if time.monotonic() >= deadline:
                    log = self.log_tail()
                    raise RealServerUnavailable(
                        f"the Conductor server was not healthy within {self.health_timeout_seconds:.0f} s; "
                        f"log {self.log_path}, last lines:\n{log}"
                    )
                time.sleep(0.25)
        finally:
            session.close()

    def stop(self, *, graceful: bool = True) -> None:
        """TERM the server's process group, KILL it after the grace period; idempotent.

        ``graceful=False`` sends KILL at once.
        """
        proc = self.proc
        if proc is not None and proc.poll() is None and not graceful:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=KILL_WAIT_SECONDS)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_seconds)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=KILL_WAIT_SECONDS)
        if proc is not None:
            # The JVM leads its own session: anything left in that group is a stray.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.workdir is not None and not self.keep_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class _PortTaken(Exception):
    """The free port we picked was taken before the server bound it."""


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        server.stop()


def process_group_alive(pgid: int) -> bool:
    """True while any process is left in the process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- pytest fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_server() -> Iterator[RealConductorServer]:
    """One real Conductor OSS server for the whole session; fails (never skips) when it cannot start."""
    try:
        java = find_java()
        jar = ensure_jar()
        server = RealConductorServer(jar, java, extra_env=SESSION_SERVER_ENV)  # a test secret: see there
        server.start()
    except RealServerUnavailable as exc:
        pytest.fail(f"real Conductor server unavailable: {exc}", pytrace=False)
    try:
        yield server
    finally:
        pid = server.pid
        server.stop()
        if pid is not None and process_group_alive(pid):
            pytest.fail(f"the Conductor server's process group {pid} survived stop()", pytrace=False)


@pytest.fixture(scope="session")
def real_server_url(real_server: RealConductorServer) -> str:
    """``http://127.0.0.1:PORT/api`` of the session's real Conductor server."""
    return real_server.url


def main(argv: Sequence[str]) -> int:
    """``python -m tests.realserver fetch``: download the jar now; prints its path."""
    if list(argv) != ["fetch"]:
        print("usage: python -m tests.realserver fetch", file=sys.stderr)
        return 2
    try:
        print(ensure_jar())
    except RealServerUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
