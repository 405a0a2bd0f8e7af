"""Task and workflow definitions (validation, defaults, retry delays) and input expressions.

Pure functions over JSON values; the store calls them under its lock. Must not touch the store.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

from leasecore.server.records import (
    JSON,
    RETRY_LOGICS,
    TASKDEF_DEFAULTS,
    TIMEOUT_POLICIES,
    as_int,
    binding_error,
    validation_failed,
)

_EXPR = re.compile(r"\$\{([^}]*)\}")
SECRET_REF = "workflow.secrets."  # resolved at the poll only (resolve_secret_refs), never stored


def _lookup(ctx: JSON, path: str) -> Any:
    cur: Any = ctx
    for part in path.strip().split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _is_secret_ref(path: str) -> bool:
    return path.strip().startswith(SECRET_REF)


def resolve_secret_refs(value: Any, secret: Callable[[str], str | None]) -> Any:
    """``value`` (a task's input) with each ``${workflow.secrets.X}`` replaced by ``secret(X)``: a
    whole-string reference takes the value (null when unknown, as the OSS server), one inside a
    longer string its text (an unknown one is left as written)."""
    if isinstance(value, str):
        if "${" not in value:
            return value
        whole = _EXPR.fullmatch(value)
        if whole and _is_secret_ref(whole.group(1)):
            return secret(whole.group(1).strip()[len(SECRET_REF):])

        def one(m: re.Match[str]) -> str:
            if not _is_secret_ref(m.group(1)):
                return m.group(0)
            found = secret(m.group(1).strip()[len(SECRET_REF):])
            return m.group(0) if found is None else found

        return _EXPR.sub(one, value)
    if isinstance(value, dict):
        return {k: resolve_secret_refs(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_secret_refs(v, secret) for v in value]
    return value


def resolve_expressions(value: Any, ctx: JSON) -> Any:
    """Resolve ``${workflow.input.x}`` / ``${ref.output.y}`` (dotted paths) in a parameter template.

    A string that is exactly one expression takes the referenced value with its JSON type; an
    expression inside a longer string is replaced by its text. Unknown paths resolve to null.
    ``${workflow.secrets.X}`` stays as written: it is resolved only into a polled copy of the task
    (``resolve_secret_refs``), so that no secret is stored.
    """
    if isinstance(value, str):
        whole = _EXPR.fullmatch(value)
        if whole:
            if _is_secret_ref(whole.group(1)):
                return value
            return copy.deepcopy(_lookup(ctx, whole.group(1)))
        if "${" in value:
            return _EXPR.sub(lambda m: m.group(0) if _is_secret_ref(m.group(1))
                             else _text(_lookup(ctx, m.group(1))), value)  # fmt: skip
        return value
    if isinstance(value, dict):
        return {k: resolve_expressions(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_expressions(v, ctx) for v in value]
    return value


def validate_task_def(td: Any, path: str) -> list[JSON]:
    errors: list[JSON] = []

    def err(field_name: str, message: str, invalid: Any = None) -> None:
        entry: JSON = {"path": f"{path}.{field_name}" if field_name else path, "message": message}
        if invalid is not None:
            entry["invalidValue"] = invalid
        errors.append(entry)

    if not isinstance(td, dict):
        err("", "TaskDef must be a JSON object")
        return errors
    name = td.get("name")
    if not isinstance(name, str) or not name.strip():
        err("name", "TaskDef name cannot be null or empty")
    rc = as_int(td.get("retryCount"), 3)
    if rc < 0:
        err("retryCount", "TaskDef retryCount: must be >= 0", rc)
    r = as_int(td.get("responseTimeoutSeconds"), 3600)
    if r < 1:
        err("responseTimeoutSeconds", f"TaskDef responseTimeoutSeconds: {r} must be greater than 0", r)
    t = as_int(td.get("timeoutSeconds"), 0)
    if t > 0 and r > t:
        err(
            "",
            f"TaskDef: {name} responseTimeoutSeconds: {r} must be less than timeoutSeconds: {t}",
        )
    total = as_int(td.get("totalTimeoutSeconds"), 0)
    if total < 0:
        err("totalTimeoutSeconds", "TaskDef totalTimeoutSeconds: must be >= 0", total)
    if t > 0 and total > 0 and t > total:
        err("", f"TaskDef: {name} timeoutSeconds: {t} must be less than totalTimeoutSeconds: {total}")
    for key in ("pollTimeoutSeconds", "retryDelaySeconds", "maxRetryDelaySeconds", "backoffJitterMs"):
        v = as_int(td.get(key), 0)
        if v < 0:
            err(key, f"TaskDef {key}: must be >= 0", v)
    if as_int(td.get("backoffScaleFactor"), 1) < 1:
        err("backoffScaleFactor", "TaskDef backoffScaleFactor: must be >= 1")
    policy = td.get("timeoutPolicy", "TIME_OUT_WF")
    if policy not in TIMEOUT_POLICIES:
        raise binding_error(f"Cannot deserialize value of type `TimeoutPolicy` from String {policy!r}")
    logic = td.get("retryLogic", "FIXED")
    if logic not in RETRY_LOGICS:
        raise binding_error(f"Cannot deserialize value of type `RetryLogic` from String {logic!r}")
    return errors


def with_defaults(td: JSON) -> JSON:
    out = copy.deepcopy(TASKDEF_DEFAULTS)
    out.update({k: v for k, v in td.items() if v is not None})
    return out


def retry_delay(td: JSON, retry_count: int) -> int:
    base = as_int(td.get("retryDelaySeconds"), 60)
    logic = td.get("retryLogic", "FIXED")
    if logic == "LINEAR_BACKOFF":
        delay = base * as_int(td.get("backoffScaleFactor"), 1) * (retry_count + 1)
    elif logic == "EXPONENTIAL_BACKOFF":
        delay = base * (2**retry_count)
    else:
        delay = base
    cap = as_int(td.get("maxRetryDelaySeconds"), 0)
    if cap > 0:
        delay = min(delay, cap)
    return max(delay, 0)


def validate_workflow_def(wd: Any, path: str) -> JSON:
    """A workflow definition checked like the real server does, with its defaults filled in."""
    if not isinstance(wd, dict):
        raise binding_error("Cannot deserialize the workflow definition: expected a JSON object")
    errors: list[JSON] = []
    name = wd.get("name")
    if not isinstance(name, str) or not name.strip():
        errors.append({"path": f"{path}.name", "message": "WorkflowDef name cannot be null or empty"})
    tasks = wd.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        errors.append({"path": f"{path}.tasks", "message": "WorkflowTask list cannot be empty"})
        tasks = []
    refs: set[str] = set()
    for i, wt in enumerate(tasks):
        tpath = f"{path}.tasks[{i}]"
        if not isinstance(wt, dict):
            raise binding_error("Cannot deserialize a WorkflowTask: expected a JSON object")
        if not isinstance(wt.get("name"), str) or not wt["name"]:
            errors.append({"path": f"{tpath}.name", "message": "WorkflowTask name cannot be empty or null"})
        ref = wt.get("taskReferenceName")
        if not isinstance(ref, str) or not ref:
            errors.append(
                {
                    "path": f"{tpath}.taskReferenceName",
                    "message": "WorkflowTask taskReferenceName name cannot be empty or null",
                }
            )
        elif ref in refs:
            errors.append({"path": tpath, "message": f"taskReferenceName: {ref} should be unique"})
        else:
            refs.add(ref)
        kind = wt.get("type", "SIMPLE")
        if kind != "SIMPLE":
            errors.append(
                {
                    "path": f"{tpath}.type",
                    "message": f"the embedded server runs only SIMPLE tasks, not {kind!r}",
                }
            )
        inline = wt.get("taskDefinition")
        if inline is not None:
            errors.extend(validate_task_def(inline, f"{tpath}.taskDefinition"))
    if errors:
        raise validation_failed(errors)
    out = copy.deepcopy(wd)
    out["version"] = as_int(wd.get("version"), 1)
    out.setdefault("schemaVersion", 2)
    out.setdefault("timeoutSeconds", 0)
    out.setdefault("timeoutPolicy", "ALERT_ONLY")
    out.setdefault("inputParameters", [])
    out.setdefault("outputParameters", {})
    for wt in out["tasks"]:
        wt.setdefault("type", "SIMPLE")
        wt.setdefault("inputParameters", {})
    return out
