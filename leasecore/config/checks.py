"""The checkers of configuration values, their text parsers, and the messages of a refused value.

Owns: what each kind of value may be (a checker takes a value as the file or a flag gives it, already
typed, and returns the clean value or raises ``ValueError`` saying what is allowed), how an
environment string becomes a typed value (``*_from_text``), and :func:`check_value` /
:func:`invalid_value`, which turn that ``ValueError`` into a ``ConfigError`` naming key, value and
source (a ``settings.Source``, or anything that prints as one: the settings declare their keys with
these checkers, so this module does not import them back), with credentials masked (a sensitive
key's value is never shown, a bad URL's password is cut).
Each key's declaration names its checker (``config.settings``); the key table is ``config.keys``.

Must not: know any key by name beyond masking (``url``, ``env``), read anything, hold defaults
(``config.settings``). Pure. Threads: none.
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
    """A rate: a number >= 0 and <= 100000 per second."""
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


# --- the exit-code policy (exit_codes): CODE -> STATUS[:SECONDS] ---------------------------------
POLICY_STATUSES = ("COMPLETED", "FAILED", "FAILED_WITH_TERMINAL_ERROR", "IN_PROGRESS")
_POLICY_ALLOWED = (
    'exit codes 1..255, each mapped to "STATUS" or "IN_PROGRESS:SECONDS" (STATUS: '
    + ", ".join(POLICY_STATUSES) + '): a table such as {3 = "FAILED_WITH_TERMINAL_ERROR", '
    '75 = "IN_PROGRESS:30"}, or CODE=STATUS[:SECONDS] on the command line'
)


def exit_rule_of(text: str) -> tuple[str, int | None]:
    """``"STATUS"`` or ``"IN_PROGRESS:SECONDS"`` as (status, seconds); ValueError if neither."""
    status, colon, seconds = text.strip().partition(":")
    status = status.strip().upper()
    if status not in POLICY_STATUSES:
        raise ValueError(_POLICY_ALLOWED)
    if not colon:
        return status, None
    if status != "IN_PROGRESS" or not seconds.strip().isdigit() or int(seconds) > MAX_SECONDS:
        raise ValueError(_POLICY_ALLOWED)
    return status, int(seconds)


def exit_code_policy(value: Any) -> dict[str, str]:
    """A table {code: "STATUS[:SECONDS]"} (file), or a list of "CODE=STATUS[:SECONDS]" (flags), as
    {"code": "STATUS[:SECONDS]"} ordered by code (TOML and JSON can print it as it is)."""
    if isinstance(value, Mapping):
        pairs = [(str(code), rule) for code, rule in value.items()]
    elif isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        pairs = [tuple(item.partition("=")[::2]) for item in value]
    else:
        raise ValueError(_POLICY_ALLOWED)
    policy: dict[int, str] = {}
    for code_text, rule in pairs:
        if not isinstance(rule, str) or not code_text.strip().isdigit() or not 1 <= int(code_text) <= 255:
            raise ValueError(_POLICY_ALLOWED)
        status, seconds = exit_rule_of(rule)
        normal = status if seconds is None else f"{status}:{seconds}"
        code = int(code_text)
        if policy.get(code, normal) != normal:
            raise ValueError(f"exit code {code} is mapped twice ({policy[code]} and {normal})")
        policy[code] = normal
    return {str(code): policy[code] for code in sorted(policy)}


def env_names(value: Any) -> tuple[str, ...]:
    allowed = "a list of environment variable names"
    if not isinstance(value, list | tuple) or not all(_is_env_name(name) for name in value):
        raise ValueError(allowed)
    return tuple(value)


def metadata_names(value: Any) -> tuple[str, ...]:
    """Runtime metadata names (``TaskDef.runtimeMetadata``): non-empty strings, any characters."""
    if not isinstance(value, list | tuple) or not all(isinstance(n, str) and n.strip() for n in value):
        raise ValueError("a list of runtime metadata names (non-empty strings)")
    return tuple(dict.fromkeys(value))


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


# ---- metrics endpoint: checkers ----------------------------------------------------------------------


def ip_literal(value: Any) -> str:
    """An IPv4 or IPv6 address to listen on (no host names: what a name resolves to may change)."""
    allowed = "an IP address to listen on, such as 127.0.0.1, 0.0.0.0 or ::1"
    if not isinstance(value, str):
        raise ValueError(allowed)
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise ValueError(allowed) from None


# ---- end metrics endpoint ----------------------------------------------------------------------------


def _is_env_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "=" not in name and "\0" not in name


def as_text(text: str) -> str:
    """A string key's parser: the environment's text as it is."""
    return text



# ---- per-task resource limits ------------------------------------------------------------------------


def byte_size(value: Any) -> int:
    """A size in bytes: 64M, 2G, or a whole number (a per-task resource limit; ``leasecore.limits``)."""
    from leasecore.limits import parse_size

    return parse_size(value)


def cpu_count(value: Any) -> float:
    """A number of CPU cores: 0.5, 2 (a per-task resource limit; ``leasecore.limits``)."""
    from leasecore.limits import parse_cpus

    return parse_cpus(value)



# ---- one key, and a refused value's message -----------------------------------------------------


@dataclass(frozen=True, eq=False)
class KeySpec:
    """One configuration key as declared on its settings field (``settings.option``), with its name,
    scope and default added (``keys.KEYS``): how it is checked, read, set and documented."""

    name: str
    scope: str  # "server" | "runner" | "task"
    check: Checker
    help: str
    from_text: Callable[[str], Any] = as_text
    env: tuple[str, ...] = ()  # fixed environment variables, first set wins (server and runner keys)
    worker_prop: str | None = None  # SDK-style per-task/all variables: conductor_worker_<task>_<prop>
    flag: str | None = None  # "--x", "--x/--no-x" (a pair), "--" (the command); None: no flag
    in_file: bool = True  # False: command-line only
    in_worker: bool = True  # task keys: may [worker] give a default for every task?
    sensitive: bool = False  # never echoed in messages or output
    default: Any = None  # the settings field's default (None too for a required key)
    flag_kind: str = "str"  # what the flag's value is: str, int, float, bool, ints / strs (repeatable)
    dest: str = ""  # the CLI override's name (``--server`` sets ``url``); "" when it is the key's name
    metavar: str | None = None  # the flag's value in --help
    flag_help: str | None = None  # the flag's own words when they differ from ``help``
    unit: str = ""  # shown after the default: "s", "ms", "checks/s"
    unset: str | None = None  # what the default None/empty means ("the hostname"); "": say nothing
    zero: str | None = None  # what 0 means, when it is the default ("none")
    example: Any = None  # shown (commented out) in ``init``'s file when the default is unset
    doc: str = ""  # more for the configuration reference (Markdown)
    restart: str | None = None  # why a reload may not change it; None: a reload may
    aliases: tuple[str, ...] = ()  # other spellings accepted in the file
    path: bool = False  # a path: relative to the config file that gave it, else to the cwd; ~/ expanded
    combined: bool = False  # task keys from the file only: [worker]'s and [[task]]'s values together

    @property
    def override(self) -> str:
        """The name of the ``run`` CLI override that sets this key."""
        return self.dest or self.name


def check_value(spec: KeySpec, value: Any, source: object) -> Any:
    """Check a typed value; a ValueError becomes a ConfigError naming key, value and source."""
    try:
        return spec.check(value)
    except ValueError as exc:
        raise invalid_value(spec, value, source, str(exc)) from None


def invalid_value(spec: KeySpec, value: Any, source: object, allowed: str) -> ConfigError:
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


