"""Every configuration key conductor-run knows: scope, checker, env names, flag and help, in one table.

Pure. Checkers take a value as the file or a flag gives it (already typed) and return the clean value
or raise ``ValueError`` saying what is allowed; ``from_text`` first turns an environment string into
a typed value. ``config.resolve`` wraps those ``ValueError`` into ``ConfigError`` with key and source.
Defaults are not here: they live on the settings dataclasses in ``config/loader.py``.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from leasecore.errors import ConfigError

TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})

Checker = Callable[[Any], Any]

# Durations above this are typos (1e300 overflows the clocks and waits): one year is the ceiling.
MAX_SECONDS = 365 * 24 * 3600


def check_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError("true or false")


def bool_from_text(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    # The Conductor SDKs read any other word as false; a typo silently disabling a lease is worse.
    raise ValueError("true/1/yes/on or false/0/no/off (unlike the Conductor SDKs, other words are an error)")


def int_range(low: int, high: int | None = None, what: str = "an integer") -> Checker:
    allowed = f"{what} from {low} to {high}" if high is not None else f"{what} >= {low}"

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(allowed)
        if value < low or (high is not None and value > high):
            raise ValueError(allowed)
        return value

    return check


def int_from_text(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("an integer") from None


def rate_per_second(value: Any) -> float:
    """A rate: a number >= 0 and <= 100000 per second (#23)."""
    allowed = "a number of checks per second >= 0 and <= 100000 (0: no limit)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(allowed)
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(allowed) from None
    if not math.isfinite(number) or number < 0 or number > 100000:
        raise ValueError(allowed)
    return number


def seconds(*, positive: bool = False) -> Checker:
    low = "> 0" if positive else ">= 0"
    allowed = f"a number of seconds {low} and <= {MAX_SECONDS} (one year)"

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(allowed)
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            raise ValueError(allowed) from None
        if not math.isfinite(number) or number < 0 or (positive and number == 0) or number > MAX_SECONDS:
            raise ValueError(allowed)
        return number

    return check


def float_from_text(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("a number") from None


def nonempty_str(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a non-empty string")
    return value


def optional_str(value: Any) -> str | None:
    """An empty string means "not set" (the server treats an empty domain as no domain)."""
    if not isinstance(value, str):
        raise ValueError("a string")
    return value or None


def choice(*options: str) -> Checker:
    def check(value: Any) -> str:
        if value not in options:
            raise ValueError(" or ".join(repr(option) for option in options))
        return str(value)

    return check


def server_url(value: Any) -> str:
    allowed = "an http:// or https:// URL with a host, such as http://localhost:8080/api"
    if not isinstance(value, str):
        raise ValueError(allowed)
    try:
        parts = urlsplit(value.strip())
        port = parts.port  # raises ValueError for a port outside 0..65535 or not a number
    except ValueError:
        raise ValueError(allowed) from None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host or parts.query or parts.fragment:
        raise ValueError(allowed)
    if any(char.isspace() for char in value.strip()) or port == 0:
        raise ValueError(allowed)
    url = value.strip().rstrip("/")
    # Every Conductor REST path lives under /api; the Java SDK appends it too when it is missing.
    return url if url.endswith("/api") else url + "/api"


def exit_codes(value: Any) -> tuple[int, ...]:
    allowed = "a list of exit codes from 1 to 255"
    if not isinstance(value, list | tuple):
        raise ValueError(allowed)
    check = int_range(1, 255, "exit codes")
    try:
        return tuple(sorted({check(code) for code in value}))
    except ValueError:
        raise ValueError(allowed) from None


def env_names(value: Any) -> tuple[str, ...]:
    allowed = "a list of environment variable names"
    if not isinstance(value, list | tuple) or not all(_is_env_name(name) for name in value):
        raise ValueError(allowed)
    return tuple(value)


def env_table(value: Any) -> dict[str, str]:
    allowed = 'a table of NAME = "string value" pairs'
    if not isinstance(value, Mapping):
        raise ValueError(allowed)
    for name, text in value.items():
        if not _is_env_name(name):
            raise ValueError(f"{allowed} ({name!r} is not a variable name)")
        if not isinstance(text, str):
            # The value itself is not echoed: env values may be credentials.
            kind = _TOML_KINDS.get(type(text), "not a string")
            raise ValueError(f'{allowed} ({name} is {kind}: quote it, {name} = "...")')
    return dict(value)


_TOML_KINDS = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "a table"}


def argv(value: Any) -> tuple[str, ...]:
    allowed = 'a non-empty list of strings, e.g. ["./encode.sh", "--fast"] (or use shell = "...")'
    if not isinstance(value, list | tuple) or not value or not all(isinstance(arg, str) for arg in value):
        raise ValueError(allowed)
    if not value[0]:
        raise ValueError(allowed)
    return tuple(value)


# ---- #20 metrics endpoint: checkers ----------------------------------------------------------------


def ip_literal(value: Any) -> str:
    """An IPv4 or IPv6 address to listen on (no host names: what a name resolves to may change)."""
    allowed = "an IP address to listen on, such as 127.0.0.1, 0.0.0.0 or ::1"
    if not isinstance(value, str):
        raise ValueError(allowed)
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise ValueError(allowed) from None


# ---- end #20 ------------------------------------------------------------------------------------------


def _is_env_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "=" not in name and "\0" not in name


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class KeySpec:
    """One configuration key."""

    name: str
    scope: str  # "server" | "runner" | "task"
    check: Checker
    help: str
    from_text: Callable[[str], Any] = _text
    env: tuple[str, ...] = ()  # fixed environment variables (server and runner keys)
    worker_prop: str | None = None  # SDK-style per-task/all variables: conductor_worker_<task>_<prop>
    flag: str | None = None
    in_file: bool = True  # False: command-line only
    in_worker: bool = True  # task keys: may [worker] give a default for every task?
    sensitive: bool = False  # never echoed in messages or output


def _key(name: str, scope: str, check: Checker, help: str, **extra: Any) -> KeySpec:
    return KeySpec(name=name, scope=scope, check=check, help=help, **extra)


_B = {"from_text": bool_from_text}
_I = {"from_text": int_from_text}
_F = {"from_text": float_from_text}

KEYS: dict[str, KeySpec] = {
    spec.name: spec
    for spec in (
        # [server]
        _key(
            "url",
            "server",
            server_url,
            "Conductor API base URL (/api is appended when missing)",
            env=("CONDUCTOR_SERVER_URL",),
            flag="--server",
        ),
        _key(
            "auth_key",
            "server",
            nonempty_str,
            "key id for token auth; prefer the environment",
            env=("CONDUCTOR_AUTH_KEY",),
            sensitive=True,
        ),
        _key(
            "auth_secret",
            "server",
            nonempty_str,
            "key secret; prefer the environment",
            env=("CONDUCTOR_AUTH_SECRET",),
            sensitive=True,
        ),
        # --- issue #21: conductor-cli's static token, CONDUCTOR_AUTH_TOKEN ----------------------
        _key(
            "auth_token",
            "server",
            nonempty_str,
            "a ready-made token sent as X-Authorization (conductor-cli's; instead of key and "
            "secret, never refreshed); prefer the environment",
            env=("CONDUCTOR_AUTH_TOKEN",),
            sensitive=True,
        ),
        # --- end #21 ------------------------------------------------------------------------
        # --- #24: secrets from a file, a private CA (server) -------------------------------------
        _key(
            "auth_secret_file",
            "server",
            nonempty_str,
            "file holding the key secret (mode 0600 or stricter: systemd/Kubernetes credentials)",
            env=("CONDUCTOR_AUTH_SECRET_FILE",),
        ),
        _key(
            "ca_bundle",
            "server",
            nonempty_str,
            "PEM file of the CA certificates to trust for https:// (a private CA)",
            # In this order, as the issue (#24) asks: the Python ssl module's, then requests', then curl's.
            env=("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"),
            flag="--ca-bundle",
        ),
        # --- end #24 ------------------------------------------------------------------------------
        # runner-wide, in [worker]
        _key(
            "state_dir",
            "runner",
            nonempty_str,
            "directory of the status snapshots read by `conductor-run status`",
            env=("CONDUCTOR_RUN_STATE_DIR",),
            flag="--state-dir",
        ),
        _key(
            "log_format",
            "runner",
            choice("text", "json"),
            "log lines as text or json",
            env=("CONDUCTOR_RUN_LOG_FORMAT",),
            flag="--log-format",
        ),
        _key(
            "drain",
            "runner",
            check_bool,
            "on the first signal, let running children finish",
            env=("CONDUCTOR_RUN_DRAIN",),
            flag="--drain",
            **_B,
        ),
        _key(
            "drain_timeout",
            "runner",
            seconds(),
            "seconds to wait for children when draining",
            env=("CONDUCTOR_RUN_DRAIN_TIMEOUT",),
            flag="--drain-timeout",
            **_F,
        ),
        # --- issue #23: the ownership checks' budget per runner ---------------------------------
        _key(
            "ownership_check_rate",
            "runner",
            rate_per_second,
            "ownership checks per second at most, shared by every task of the runner (0: no "
            "limit); each task is checked every max(ownership_check_interval, tasks / rate) s",
            env=("CONDUCTOR_RUN_OWNERSHIP_CHECK_RATE",),
            **_F,
        ),
        # --- end #23 ------------------------------------------------------------------------
        _key("once", "runner", check_bool, "run one task, then exit", flag="--once", in_file=False),
        _key(
            "once_wait",
            "runner",
            seconds(positive=True),
            "--once: seconds to wait for a task before exiting 6",
            flag="--once-wait",
            in_file=False,
            **_F,
        ),
        _key(
            "max_tasks",
            "runner",
            int_range(1),
            "exit after this many tasks (exit 5 when any of them failed)",
            flag="--max-tasks",
            in_file=False,
        ),
        # ---- #20 metrics endpoint (runner-wide, [worker]) ----
        _key(
            "metrics_port",
            "runner",
            int_range(0, 65535, "a TCP port"),
            "serve /metrics, /healthz and /readyz on this port (0: any free port, logged)",
            env=("CONDUCTOR_RUN_METRICS_PORT",),
            flag="--metrics-port",
            **_I,
        ),
        _key(
            "metrics_host",
            "runner",
            ip_literal,
            "the address the metrics endpoint listens on",
            env=("CONDUCTOR_RUN_METRICS_HOST",),
            flag="--metrics-host",
        ),
        # ---- end #20 ----
        # ---- #20 metrics: the task type's label name (promtool's snake_case lint) ----
        _key(
            "metrics_task_type_label",
            "runner",
            choice("taskType", "task_type"),
            "the metrics' label name for the task type: taskType (the Conductor SDKs' name, which "
            "their dashboards query) or task_type (snake_case: promtool check metrics finds nothing)",
            env=("CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL",),
            flag="--metrics-task-type-label",
        ),
        # ---- end #20 metrics label ----
        # per task ([[task]], defaults in [worker])
        _key(
            "type",
            "task",
            nonempty_str,
            "the Conductor task type to poll",
            flag="--task-type",
            in_worker=False,
        ),
        _key(
            "command",
            "task",
            argv,
            "argv to run (no shell); exactly one of command / shell",
            flag="--",
            in_worker=False,
        ),
        _key(
            "shell",
            "task",
            nonempty_str,
            "a string run with /bin/sh -c; task input never enters it",
            flag="--shell",
            in_worker=False,
        ),
        _key("cwd", "task", nonempty_str, "working directory (relative: to the config file's directory)"),
        _key("env", "task", env_table, "extra environment variables for the child ([worker] + [[task]])"),
        _key(
            "concurrency",
            "task",
            int_range(1, 1000),
            "children run at once (SDK: thread_count)",
            worker_prop="thread_count",
            flag="--concurrency",
            **_I,
        ),
        _key(
            "worker_id",
            "task",
            nonempty_str,
            "worker id reported to the server",
            worker_prop="worker_id",
            flag="--worker-id",
        ),
        _key(
            "domain",
            "task",
            optional_str,
            "task domain to poll (empty: none)",
            worker_prop="domain",
            flag="--domain",
        ),
        _key(
            "lease_extend_enabled",
            "task",
            check_bool,
            "send extendLease heartbeats",
            worker_prop="lease_extend_enabled",
            flag="--lease-extend/--no-lease-extend",
            **_B,
        ),
        _key(
            "heartbeat_timeout",
            "task",
            seconds(positive=True),
            "seconds without an acknowledged heartbeat before the child is killed",
            worker_prop="heartbeat_timeout",
            flag="--heartbeat-timeout",
            **_F,
        ),
        _key(
            "kill_grace",
            "task",
            seconds(),
            "seconds between SIGTERM and SIGKILL (capped at a quarter of each task's lease)",
            worker_prop="kill_grace",
            flag="--kill-grace",
            **_F,
        ),
        _key(
            "exec_timeout",
            "task",
            seconds(),
            "kill the child after this many seconds (0: never)",
            worker_prop="exec_timeout",
            flag="--exec-timeout",
            **_F,
        ),
        _key(
            "terminal_exit_codes",
            "task",
            exit_codes,
            "exit codes reported FAILED_WITH_TERMINAL_ERROR",
            flag="--terminal-exit-code",
        ),
        _key(
            "in_progress_exit_code",
            "task",
            int_range(1, 255, "an exit code"),
            "exit code that hands the task back as IN_PROGRESS, to be polled again later",
        ),
        _key(
            "callback_after_seconds",
            "task",
            int_range(0, MAX_SECONDS, "whole seconds"),
            "with in_progress_exit_code: when the server hands the task out again",
        ),
        _key(
            "poll_timeout",
            "task",
            int_range(0, 5000, "milliseconds"),
            "long-poll wait in ms (<= 5000)",
            worker_prop="poll_timeout",
            flag="--poll-timeout",
            **_I,
        ),
        _key(
            "poll_interval",
            "task",
            int_range(0, MAX_SECONDS * 1000, "milliseconds"),
            "pause in ms after an empty poll",
            worker_prop="poll_interval",
            **_I,
        ),
        _key(
            "paused",
            "task",
            check_bool,
            "do not poll this task (SDK pause switch)",
            worker_prop="paused",
            **_B,
        ),
        _key(
            "ownership_check_interval",
            "task",
            seconds(positive=True),
            "seconds between GET /api/tasks/{id} ownership checks",
        ),
        # --- issue #21: conductor-cli's `worker stdio` contract -------------------------------
        _key(
            "protocol",
            "task",
            choice("native", "stdio"),
            "the child's contract: native (input on stdin, exit code, output file) or stdio "
            "(conductor-cli worker stdio: the task on stdin, one JSON result on stdout)",
            worker_prop="protocol",
            flag="--protocol",
        ),
        # --- end #21 ------------------------------------------------------------------------
        _key(
            "secrets",
            "task",
            env_names,
            "names of runner environment variables never passed to the child ([worker] + [[task]])",
        ),
        # --- #24: privilege drop (task) --------------------------------------------------------
        _key(
            "user",
            "task",
            nonempty_str,
            "run each child as this user (name or uid; the runner must be root)",
            flag="--user",
        ),
        _key(
            "group",
            "task",
            nonempty_str,
            "with user: run each child with this group (name or gid) instead of the user's own",
            flag="--group",
        ),
        # --- end #24 ------------------------------------------------------------------------------
    )
}

# --- issue 19: resource limits per task tree, and the cgroup mechanism ------------------------------
# (limits.py parses the values; cgroups.py enforces them per tree, else rlimits per process.)


def _size(value: Any) -> int:
    from leasecore.limits import parse_size

    return parse_size(value)


def _cpus(value: Any) -> float:
    from leasecore.limits import parse_cpus

    return parse_cpus(value)


KEYS.update(
    {
        spec.name: spec
        for spec in (
            _key(
                "cgroup",
                "runner",
                choice("auto", "v2", "v1", "off"),
                "task trees in cgroups: auto (v2 if it can limit, else v1, else none), v2, v1 or off",
                env=("CONDUCTOR_RUN_CGROUP",),
                flag="--cgroup",
            ),
            _key(
                "memory_max",
                "task",
                _size,
                "memory limit of the task's tree (64M, 2G; per process where no cgroup can enforce it)",
                worker_prop="memory_max",
                flag="--memory-max",
            ),
            _key(
                "pids_max",
                "task",
                int_range(1, 4_194_304),
                "most processes the task's tree may hold at once",
                worker_prop="pids_max",
                flag="--pids-max",
                **_I,
            ),
            _key(
                "cpu_max",
                "task",
                _cpus,
                "CPU cores the task's tree may use (0.5, 2; needs a cgroup cpu controller)",
                worker_prop="cpu_max",
                flag="--cpu-max",
            ),
            _key(
                "nofile",
                "task",
                int_range(1, 1 << 30),
                "open files per process of the task's tree (RLIMIT_NOFILE)",
                worker_prop="nofile",
                flag="--nofile",
                **_I,
            ),
        )
    }
)
# --- end of issue 19 ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where one value came from: ``layer`` is default | file | env | flag; ``where`` says exactly."""

    layer: str
    where: str = ""

    def __str__(self) -> str:
        return self.where or self.layer


def check_value(spec: KeySpec, value: Any, source: Source) -> Any:
    """Check a typed value; a ValueError becomes a ConfigError naming key, value and source."""
    try:
        return spec.check(value)
    except ValueError as exc:
        raise invalid_value(spec, value, source, str(exc)) from None


def invalid_value(spec: KeySpec, value: Any, source: Source, allowed: str) -> ConfigError:
    if spec.name == "url" and isinstance(value, str):
        value = _mask_invalid_url(value)
    shown = "" if spec.sensitive or spec.name == "env" else f" = {_short(value)}"
    return ConfigError(
        f"invalid {spec.name}{shown} (from {source}): expected {allowed}", key=spec.name, source=str(source)
    )


_QUERY = re.compile(r"[?#].*", re.DOTALL)


def _mask_invalid_url(url: str) -> str:
    """A URL that failed validation, fit for a message: everything before its last ``@`` (after the
    scheme, if any) and its query and fragment become ``***``. Crude on purpose: the URL is malformed,
    so no parser can be trusted to find its password (one with a ``/`` or an ``@`` in it, or no
    scheme); it is masked before the value is cut short (a cut could fall between password and ``@``)."""
    before, at, after = url.rpartition("@")
    if at:
        scheme, slashes, _ = before.partition("://")
        url = (f"{scheme}://" if slashes else "") + "***@" + after
    return _QUERY.sub("?***", url)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Other spellings accepted in the file.
ALIASES = {"thread_count": "concurrency"}


def keys_of(scope: str) -> list[KeySpec]:
    return [spec for spec in KEYS.values() if spec.scope == scope]
