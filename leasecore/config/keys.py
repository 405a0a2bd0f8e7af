"""Every configuration key conductor-run knows, as data: scope, checker, env names, flag, help.

Owns: :data:`KEYS`, the one table of keys (add a key here, and its default on the settings
dataclass, ``config.settings``), a row being a :class:`KeySpec` (defined in ``config.checks``), the
file's other spellings (:data:`ALIASES`) and :func:`keys_of`. A row names its checker and text parser
(``config.checks``); the merge (``config.merge``) reads the table, and so do the TOML view
(``config.tomlfile``), the CLI's options and help (``cli/runoptions.py``, ``cli/fastrun.py``'s flag
table, kept equal by a drift test) and the docs.

Must not: hold checking code (``config.checks``), defaults (``config.settings``) or I/O. Pure.
Threads: none; the table is built once at import and never changed.
"""

from __future__ import annotations

from typing import Any

from leasecore.config.checks import (
    MAX_SECONDS,
    Checker,
    KeySpec,
    argv,
    bool_from_text,
    byte_size,
    check_bool,
    check_value,
    choice,
    cpu_count,
    env_names,
    env_table,
    exit_code_policy,
    exit_codes,
    float_from_text,
    int_from_text,
    int_range,
    invalid_value,
    ip_literal,
    metadata_names,
    nonempty_str,
    optional_str,
    rate_per_second,
    seconds,
    server_url,
)
from leasecore.config.settings import Source

# Re-exported: the checkers' messages and the provenance type were this module's before the split.
__all__ = ["ALIASES", "KEYS", "KeySpec", "Source", "check_value", "invalid_value", "keys_of"]

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
        # --- the child may be handed the runner's credentials, on request only -----------------
        _key(
            "pass_credentials",
            "server",
            check_bool,
            "hand the runner's credentials to every child (CONDUCTOR_AUTH_*, CONDUCTOR_ACCESS_KEY_*) "
            "so it can call back into Conductor; off: no child sees them",
            env=("CONDUCTOR_RUN_PASS_CREDENTIALS",),
            flag="--pass-credentials",
            **_B,
        ),
        # --- end pass_credentials -----------------------------------------------------------------
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
        _key(
            "update_v2",
            "runner",
            check_bool,
            "report final results with update-v2 when the server has it, claiming each next task "
            "in the same call (false: v1 POST /api/tasks only, a poll per task)",
            env=("CONDUCTOR_RUN_UPDATE_V2",),
            **_B,
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
        # --- the exit-code policy; terminal_exit_codes / in_progress_exit_code are its shorthands --
        _key(
            "exit_codes",
            "task",
            exit_code_policy,
            "exit-code policy: CODE = STATUS[:SECONDS] (COMPLETED, FAILED, FAILED_WITH_TERMINAL_ERROR, "
            "IN_PROGRESS with its callbackAfterSeconds)",
            flag="--exit-code",
        ),
        # --- end exit-code policy ---
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
        # --- secrets the Conductor way: runtime metadata this worker requires (docs/secrets.md) ------
        _key(
            "required_secrets",
            "task",
            metadata_names,
            "runtime metadata names every task must carry resolved (else FAILED_WITH_TERMINAL_ERROR, "
            "the command not run), on top of those its task definition declares",
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
                byte_size,
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
                cpu_count,
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


# Other spellings accepted in the file.
ALIASES = {"thread_count": "concurrency"}


def keys_of(scope: str) -> list[KeySpec]:
    """The keys of ``scope`` (server | runner | task), in the table's order."""
    return [spec for spec in KEYS.values() if spec.scope == scope]

