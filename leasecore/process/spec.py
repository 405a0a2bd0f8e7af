"""What to run and what came of it: ``CommandSpec``, ``ChildExit``, and the child's environment.

Owns the two values the rest of the code passes around (``CommandSpec``: the command for one task
type, its working directory, extra variables, exit-code mapping, grace, protocol, ``run_as`` and
limits; ``ChildExit``: exit code or signal, duration, tails, the output file's object or why it
was unusable, resources, OOM kills, or ``start_error`` for a command that never ran) and the whole
of DESIGN.md §3's environment contract: ``inherited_env`` (the runner's environment and the spec's,
minus credentials by ``CREDENTIAL_PATTERNS`` and the spec's secret names, minus what exec cannot
carry) and ``build_child_env`` (plus the task's ``CONDUCTOR_*`` variables and its input scalars as
data, within exec's size budgets).

Must not touch: processes, files, the clock. Pure: the Supervisor (``prepare.py``) and the CLI's
re-exec (``is_secret_name``) call it; a credential must never survive its filters.

Threads: any; the Supervisor calls it on the thread that starts a spawn.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from leasecore.errors import SpawnError
from leasecore.limits import Limits
from leasecore.masking import Masker
from leasecore.models import Task, TaskStatus
from leasecore.process.linux.procfs import TREE_MARKER
from leasecore.process.secretenv import SECRETS_FILE_ENV, metadata_env

if TYPE_CHECKING:  # the user switch is loaded only for a task with a user (start-up CPU)
    from leasecore.process.linux.runas import RunAs

# Linux refuses a single environment string over 128 KiB (MAX_ARG_STRLEN) and the whole of argv+env
# over a quarter of the stack limit: input values are always in stdin and the input file, and only
# the ones that fit these budgets are copied into CONDUCTOR_INPUT_<KEY> as well. The total counts
# what exec counts: name, value, "=", the NUL and the pointer of every entry (many tiny keys cost
# as much as a few big values).
INPUT_ENV_VALUE_LIMIT_BYTES = 64 * 1024
INPUT_ENV_TOTAL_LIMIT_BYTES = 256 * 1024
_ENV_ENTRY_OVERHEAD = 2 + 8  # "=" + NUL + the envp pointer

# Names the runner sets itself under the CONDUCTOR_INPUT_ prefix: no input key may take them.
RESERVED_INPUT_NAMES = frozenset({"CONDUCTOR_INPUT_FILE"})
# Set by the runner for every task: an inherited value would lie to a task that has none.
_PER_TASK_NAMES = ("CONDUCTOR_CHECKPOINT_FILE", "CONDUCTOR_DEADLINE")

# Never handed to a child, whatever the configuration says (matched case-insensitively).
# CONDUCTOR_ACCESS_KEY_*: the names conductor-cli hands its stdio children.
CREDENTIAL_PATTERNS = (
    "CONDUCTOR_AUTH_*", "CONDUCTOR.AUTH.*", "CONDUCTOR_SERVER_AUTH*", "CONDUCTOR_ACCESS_KEY_*"
)  # fmt: skip


NATIVE = "native"  # the protocol: this project's (task files, exit codes)
STDIO = "stdio"  # conductor-cli's (the task on stdin, a result document on stdout)


def stdio_env(task: Task) -> dict[str, str]:
    """The variables conductor-cli sets for its child (``POLL_DOMAIN`` only for a task with a domain)."""
    env = {
        "TASK_TYPE": task.task_type,
        "TASK_ID": task.task_id,
        "WORKFLOW_ID": task.workflow_id,
        "EXECUTION_ID": task.workflow_id,
    }
    if task.domain:
        env["POLL_DOMAIN"] = task.domain
    return env


class ExitRule(NamedTuple):
    """What one exit code means (the exit-code policy): a status, and for IN_PROGRESS when the server
    hands the task out again (None: the spec's ``callback_after_seconds``)."""

    status: TaskStatus
    callback_after_seconds: int | None = None


@dataclass(frozen=True)
class CommandSpec:
    """The command for one task type, and how its exit maps to a task status.

    Exactly one of ``argv`` (run directly) or ``shell`` (run as ``/bin/sh -c SHELL``) is set.
    ``env`` adds to (or overrides) the runner's environment; ``secret_env_names`` are extra names or
    glob patterns removed from both, on top of ``CREDENTIAL_PATTERNS`` (a secret name set in ``env``
    does not reach the child either). ``protocol``: ``"native"`` (DESIGN.md §3) or ``"stdio"``
    (conductor-cli's contract, ``stdio_protocol.py``). ``run_as``: the user the child runs as (HOME,
    USER and LOGNAME then name it; its task files are its own). ``kill_grace_seconds`` is the
    TERM -> KILL grace for this task's tree. ``exec_timeout_seconds`` is enforced by the lease engine
    (FenceReason.EXEC_TIMEOUT); here it only words the reason. ``masker``: secret values masked in
    the child's output (docs/secrets.md).
    """

    argv: tuple[str, ...] | None = None
    shell: str | None = None
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    terminal_exit_codes: frozenset[int] = frozenset()
    in_progress_exit_code: int | None = None
    callback_after_seconds: int = 60
    exit_codes: Mapping[int, ExitRule] = field(default_factory=dict)  # the policy; shorthands above
    exec_timeout_seconds: float = 0.0
    kill_grace_seconds: float = 10.0
    secret_env_names: tuple[str, ...] = ()
    protocol: str = NATIVE
    run_as: RunAs | None = None  # run the child as this user (the runner is root)
    limits: Limits = field(default_factory=Limits)  # per tree where cgroups allow, else rlimits
    # Set after the credential filter, on purpose: CONDUCTOR_SERVER_URL always, and the runner's
    # credentials when pass_credentials asks for them (``leasecore.runner.childenv``). Their values
    # are secrets to mask in whatever the child prints: ``childenv.credential_values``.
    handed_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Secret values masked in the child's output before any line, tail or sink sees it (masking.py;
    # the runner sets one per task: its type's values plus the task's runtime metadata's).
    masker: Masker | None = field(default=None, repr=False, compare=False)

    def command_argv(self) -> list[str]:
        """The argv to exec (``/bin/sh -c`` for a shell string); SpawnError when ill-formed."""
        if (self.argv is None) == (self.shell is None):
            raise SpawnError("give exactly one of a command (after --) or --shell")
        if self.shell is not None:
            return ["/bin/sh", "-c", self.shell]
        if not self.argv:
            raise SpawnError("the command is empty")
        return list(self.argv)


@dataclass(frozen=True, eq=False)
class ChildExit:
    """How a task's direct child ended, with bounded output tails and the output-file object.

    Exactly one of ``exit_code`` / ``signal`` is set, or neither when the command never ran:
    ``start_error`` then says why (only from ``Supervisor.start``; ``Supervisor.spawn`` raises it as a
    ``SpawnError`` or ``ProcessError``). ``output`` is the JSON object the child wrote to
    CONDUCTOR_OUTPUT_FILE (None when it wrote nothing); ``output_error`` says why that file could not
    be used. ``stdout_document``: the whole stdout (at most ``stdio_protocol.STDOUT_LIMIT_BYTES`` + 1 bytes)
    under the stdio protocol, None otherwise (stdout then streams as lines, with a tail).
    """

    exit_code: int | None
    signal: int | None
    duration_seconds: float
    stdout_tail: str = ""
    stderr_tail: str = ""
    output: Mapping[str, Any] | None = None
    output_error: str | None = None
    start_error: str | None = None
    stdout_document: bytes | None = None
    stdout_bytes: int | None = None  # with stdout_document: how many bytes the child printed in all
    # What the tree used (max_rss_bytes, cpu_user_seconds, cpu_system_seconds; see cgroupfs), how many
    # of its processes the OOM killer killed inside its group, and what enforced memory_max there:
    # "cgroup", "rlimit" (per process) or None (no memory limit).
    resources: Mapping[str, float] | None = None
    oom_kills: int = 0
    memory_limit_by: str | None = None
    # What CONDUCTOR_CHECKPOINT_FILE held at the exit (a checkpoint.CheckpointRead; None: not read).
    checkpoint: Any = None


def input_env_name(key: str) -> str:
    """``CONDUCTOR_INPUT_<KEY>``: key upper-cased, every character outside [A-Z0-9_] becomes ``_``."""
    return "CONDUCTOR_INPUT_" + re.sub(r"[^A-Z0-9_]", "_", key.upper())


def _exec_safe(text: str) -> bool:
    """Whether exec can carry ``text`` as is: no NUL byte, and strict UTF-8 (no lone surrogates)."""
    if "\0" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scalar_text(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    return None  # objects, arrays and null: read them from stdin or the input file


@functools.lru_cache(maxsize=4096)  # the same environment names at every spawn: match them once
def is_secret_name(name: str, extra_patterns: tuple[str, ...] = ()) -> bool:
    """True when ``name`` matches a credential pattern (case-insensitive)."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p.upper()) for p in (*CREDENTIAL_PATTERNS, *extra_patterns))


def inherited_env(base: Mapping[str, str], spec: CommandSpec) -> dict[str, str]:
    """What every task of ``spec`` inherits: ``base`` + ``spec.env``, minus secrets, stale
    ``CONDUCTOR_INPUT_*`` values and what exec cannot carry. The same for every task of ``spec``: a
    caller may keep it and hand it to ``build_child_env`` (``Supervisor`` does, per spec)."""
    merged = {**base, **(spec.run_as.env() if spec.run_as is not None else {}), **spec.env}
    return {
        name: value
        for name, value in merged.items()
        if not is_secret_name(name, spec.secret_env_names)
        and not name.upper().startswith("CONDUCTOR_INPUT_")  # stale values from the runner's own env
        and _exec_safe(name)
        and _exec_safe(value)
    }


def build_child_env(
    base: Mapping[str, str],
    spec: CommandSpec,
    task: Task,
    *,
    worker_id: str,
    input_file: str,
    output_file: str,
    tree_token: str,
    inherited: Mapping[str, str] | None = None,
    checkpoint_file: str = "",
    deadline: float | None = None,
    secrets_file: str | None = None,
) -> dict[str, str]:
    """The child's whole environment: ``base`` + ``spec.env``, minus secrets, plus the task's variables.

    Input values are copied as data (environment values), never into a command line. A scalar is
    left out (it is still in stdin and the input file) when exec could not carry it (NUL byte, lone
    surrogate, over the size budgets), when its name is reserved (``CONDUCTOR_INPUT_FILE``), or when
    two keys map to the same name (``a-b`` and ``A_B``): neither is set rather than a guess.
    ``inherited``: ``inherited_env(base, spec)`` computed earlier (it filters every variable).
    ``checkpoint_file``: CONDUCTOR_CHECKPOINT_FILE; ``deadline``: CONDUCTOR_DEADLINE (epoch seconds,
    the earliest time the runner will end the tree for a reason known now; None: no such time).
    ``secrets_file``: the task's runtime metadata file (``secretenv``): named by
    ``CONDUCTOR_SECRETS_FILE``, its names added as variables where ``secretenv.metadata_env`` allows.
    """
    env = dict(inherited_env(base, spec) if inherited is None else inherited)
    for name in _PER_TASK_NAMES:
        env.pop(name, None)
    task_vars = {
        "CONDUCTOR_TASK_ID": task.task_id,
        "CONDUCTOR_WORKFLOW_ID": task.workflow_id,
        "CONDUCTOR_TASK_TYPE": task.task_type,
        "CONDUCTOR_TASK_REF_NAME": task.reference_name,
        "CONDUCTOR_RETRY_COUNT": str(task.retry_count),
        "CONDUCTOR_POLL_COUNT": str(task.poll_count),
        "CONDUCTOR_WORKER_ID": worker_id,
        "CONDUCTOR_INPUT_FILE": input_file,
        "CONDUCTOR_OUTPUT_FILE": output_file,
    }
    if checkpoint_file:
        task_vars["CONDUCTOR_CHECKPOINT_FILE"] = checkpoint_file
    if deadline is not None:
        task_vars["CONDUCTOR_DEADLINE"] = str(int(deadline))  # whole seconds, rounded down: never late
    # The task's identity comes from the server: a value exec cannot carry is dropped, not fatal.
    # (The inherited part is filtered already: only these need the check.)
    for name, value in task_vars.items():
        if _exec_safe(value):
            env[name] = value
        else:
            env.pop(name, None)
    claims: dict[str, int] = {}
    for key in task.input_data:
        name = input_env_name(str(key))
        claims[name] = claims.get(name, 0) + 1
    budget = INPUT_ENV_TOTAL_LIMIT_BYTES
    for key, value in task.input_data.items():
        name = input_env_name(str(key))
        text = _scalar_text(value)
        if text is None or claims[name] > 1 or name in RESERVED_INPUT_NAMES or not _exec_safe(text):
            continue
        size = len(text.encode())
        if size > INPUT_ENV_VALUE_LIMIT_BYTES:
            continue
        budget -= len(name) + size + _ENV_ENTRY_OVERHEAD
        if budget < 0:
            break
        env[name] = text
    # Handed on purpose (the server's URL; credentials only when asked for): past the filter above.
    env.update((name, value) for name, value in spec.handed_env.items() if _exec_safe(value))
    if spec.protocol == STDIO:  # conductor-cli's names, beside ours (no stale POLL_DOMAIN inherited)
        env.pop("POLL_DOMAIN", None)
        env.update((name, value) for name, value in stdio_env(task).items() if _exec_safe(value))
    if secrets_file is not None:  # the task's runtime metadata: last, so it never overrides the above
        env.update(metadata_env(task.runtime_metadata, env,
                                lambda name: is_secret_name(name, spec.secret_env_names)))
        env[SECRETS_FILE_ENV] = secrets_file
    env[TREE_MARKER] = tree_token
    return env
