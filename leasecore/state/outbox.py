"""Results that could not be delivered, kept on disk and delivered on the next start (or sooner).

What a failed delivery means is the final-update table's (``leasecore.lease.finalfailure.decide``
with ``saved``), and what that means for the file is ``leasecore.state.redelivery``'s: kept while
the server is unreachable or refuses our credentials, dropped on a refusal (a terminal result whose
body was refused goes out bare first, as the reporter does), counted delivered on a 2xx we could not
read.

Owns: ``<state_dir>/outbox/``, one private file per task (directory 0700, files 0600: outputs are the
task's data) recording the server it was meant for (a hash of the URL: no credential reaches the
disk), when it was saved and the pollCount we held. A file is dropped once delivered, on a 4xx (404:
the task or workflow is gone; not 401/403, which only refuse our credentials), after
``max_age_seconds`` (24 h), or when the task, read back first (``read_task``), is no longer ours:
terminal, re-queued, gone, or polled again since (``finalfailure.saved_result_lost_reason``: a terminal
result's own park, SCHEDULED under its pollCount, is still ours), since our old
result would overwrite another worker's run. Runners sharing a directory **claim** a result before
sending it (a rename to ``.claim-<pid>-<start time>-<name>`` succeeds once); kept, it is renamed
back unless a newer save took its name; a dead runner's claims are put back by the next delivery.

Must not: talk to the server itself (``deliver`` is handed ``update`` and ``read_task``).
Threads: ``save`` on the reporter's threads (and the start-up sweep's), ``deliver`` on the caller's
(the start, then the wiring's ``outbox-redelivery`` thread); claims keep them apart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorAuthError, ConductorError
from leasecore.lease.finalfailure import Attempt, bare_result, decide, failure_of, saved_result_lost_reason
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.state.statefile import ProcessState, probe_process, process_start_ticks

# CPython's own SHA-256 (the same digest): hashlib would load OpenSSL, ~3 ms of every start, for the
# one digest server_key takes; hashlib only where neither module exists.
if TYPE_CHECKING:
    from hashlib import sha256 as _sha256

    from leasecore.state.redelivery import Drop, Fate
else:
    try:
        from _sha2 import sha256 as _sha256  # CPython 3.12+
    except ImportError:
        try:
            from _sha256 import sha256 as _sha256  # CPython 3.11
        except ImportError:
            from hashlib import sha256 as _sha256

log = logging.getLogger("conductor_run.outbox")

DEFAULT_MAX_AGE_SECONDS = 24 * 3600.0
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_CLAIM = re.compile(r"\.claim-(\d+)-(\d+)-(.+\.json)")  # .claim-<pid>-<start time>-<name>


def _this_process() -> str:
    """``<pid>-<start time>``: who holds a claim (a recycled pid has another start time)."""
    return f"{os.getpid()}-{process_start_ticks(os.getpid()) or 0}"


def _alive(pid: int, start_time: int) -> bool:
    # The status snapshot's rule (pid, then start time where /proc has one).
    return probe_process(pid, start_time or None) is ProcessState.ALIVE


def _put_back(claim: Path, path: Path) -> None:
    """Rename a claimed file back to ``path``, unless a newer save took that name meanwhile (then the
    claimed, older result goes): a link cannot replace an existing file, a rename could."""
    try:
        os.link(claim, path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        return
    except OSError:  # no hard links on this file system: a rename, if the name is still free
        if path.exists():
            claim.unlink(missing_ok=True)
        else:
            with contextlib.suppress(OSError):  # else the claim stays, put back once we are gone
                os.rename(claim, path)
        return
    claim.unlink(missing_ok=True)


def still_saved(paths: Collection[Path]) -> set[Path]:
    """Which of ``paths`` (files ``Outbox.save`` returned) still wait for delivery: a file being
    sent right now (claimed, renamed) still counts, until it is delivered or dropped."""
    present: set[Path] = set()
    for directory in {path.parent for path in paths}:
        try:
            with os.scandir(directory) as found:
                names = {m.group(3) if (m := _CLAIM.fullmatch(e.name)) else e.name for e in found}
        except OSError:
            continue
        present |= {path for path in paths if path.parent == directory and path.name in names}
    return present


def server_key(base_url: str) -> str:
    """A stable, credential-free name for a server URL."""
    return _sha256(base_url.rstrip("/").encode()).hexdigest()[:16]


def result_from_json(body: dict[str, Any]) -> TaskResult:
    """The inverse of ``TaskResult.to_json`` (execution logs are not kept)."""
    return TaskResult(
        task_id=str(body["taskId"]),
        workflow_id=str(body["workflowInstanceId"]),
        status=TaskStatus(body["status"]),
        output_data=dict(body.get("outputData") or {}),
        reason_for_incompletion=body.get("reasonForIncompletion"),
        callback_after_seconds=int(body.get("callbackAfterSeconds") or 0),
        worker_id=body.get("workerId"),
    )


@dataclass(frozen=True, eq=False)
class OutboxEntry:
    """One saved result, as read from its file."""

    path: Path
    result: TaskResult
    saved_at: float  # wall clock, epoch seconds (comparable across runs, unlike monotonic time)
    poll_count: int = 0  # the task's pollCount when we held it (0: unknown, never compared)
    inode: int = 0  # of the file read: a newer save of the same task (a new file) is not this entry

    def forget(self) -> None:
        """Delete this entry's file, unless a newer result of the same task replaced it meanwhile
        (the reporter saves by rename: a new inode), which must not go with it."""
        try:
            if self.inode and self.path.stat().st_ino != self.inode:
                return
        except FileNotFoundError:
            return
        self.path.unlink(missing_ok=True)

    def claim(self, owner: str) -> Path | None:
        """Take this entry's file for sending (see the module docstring); None when another runner has
        it, or when the file is no longer the one read (a newer save: left for the next round)."""
        claimed = self.path.with_name(f".claim-{owner}-{self.path.name}")
        try:
            os.rename(self.path, claimed)
        except FileNotFoundError:
            return None
        try:
            inode = claimed.stat().st_ino
        except FileNotFoundError:
            return None
        if self.inode and inode != self.inode:
            _put_back(claimed, self.path)
            return None
        return claimed


@dataclass(frozen=True)
class DeliveryReport:
    """What one ``deliver`` did with the saved results."""

    delivered: int = 0
    dropped: int = 0
    kept: int = 0


class Outbox:
    """Undelivered final results for one server, in ``directory``."""

    def __init__(
        self,
        directory: Path,
        *,
        server: str,
        clock: Clock | None = None,
        max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS,
    ) -> None:
        self.directory = directory
        self._server = server_key(server)
        self._clock = clock or SystemClock()
        self.max_age_seconds = max_age_seconds
        self._owner = _this_process()

    @classmethod
    def for_key(cls, directory: Path, key: str, *, clock: Clock | None = None) -> Outbox:
        """The outbox of the server whose ``server_key`` is ``key`` (the URL itself is not known)."""
        outbox = cls(directory, server="", clock=clock)
        outbox._server = key
        return outbox

    def _path_for(self, task_id: str) -> Path:
        # One file per (server, task): the same task id on two servers must not collide.
        return self.directory / f"{self._server}-{_SAFE.sub('_', task_id)}.json"

    def any_saved(self) -> bool:
        """Whether a result for this server waits here: a cheap look at the names, no file is read
        (another server's results, which ``entries`` would read and skip, do not count)."""
        prefix = f"{self._server}-"
        try:
            with os.scandir(self.directory) as found:
                return any(self._ours(e.name, prefix) for e in found)
        except OSError:
            return False

    def saved_count(self) -> int:
        """How many results for this server wait here (claimed ones included), from the names only."""
        prefix = f"{self._server}-"
        try:
            with os.scandir(self.directory) as found:
                return sum(1 for e in found if self._ours(e.name, prefix))
        except OSError:
            return 0

    @staticmethod
    def _ours(name: str, prefix: str) -> bool:
        """A saved result of ours, or a claim of one (its runner may have died: a delivery puts it back)."""
        claim = _CLAIM.fullmatch(name)
        if claim is not None:
            name = claim.group(3)
        return name.startswith(prefix) and name.endswith(".json")

    def _recover_claims(self) -> None:
        """Put back the claims of our server's results whose runner is gone."""
        prefix = f"{self._server}-"
        try:
            with os.scandir(self.directory) as found:
                claims = [(e.name, _CLAIM.fullmatch(e.name)) for e in found]
        except OSError:
            return
        for name, claim in claims:
            if claim is None or not claim.group(3).startswith(prefix):
                continue
            if not _alive(int(claim.group(1)), int(claim.group(2))):
                _put_back(self.directory / name, self.directory / claim.group(3))

    def has_saved(self, task_id: str) -> bool:
        """Whether a result of ``task_id`` for this server is waiting here, or claimed for sending (by a
        runner that may have died: it is put back, and must not lose to a newer save meanwhile)."""
        path = self._path_for(task_id)
        if path.is_file():
            return True
        return bool(still_saved([path]))

    def save(self, result: TaskResult, *, poll_count: int = 0) -> Path:
        """Write ``result`` atomically to a private file; returns its path.

        ``poll_count``: the newest pollCount delivered to us; at delivery a higher one on the server
        means someone polled the task again, and the result is dropped.
        """
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        body = {
            "version": 1,
            "server": self._server,
            "saved_at": self._clock.now().timestamp(),
            "poll_count": poll_count,
            "result": result.to_json(),
        }
        path = self._path_for(result.task_id)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:  # mkstemp creates it 0600
                json.dump(body, fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def entries(self) -> list[OutboxEntry]:
        """Saved results meant for this server, oldest first; unreadable files are dropped."""
        if not self.directory.is_dir():
            return []
        found: list[OutboxEntry] = []
        for path in sorted(self.directory.glob("*.json")):
            if path.name.startswith("."):  # a save in progress (.tmp-*): not a result yet, not ours to drop
                continue
            try:
                with open(path, encoding="utf-8") as handle:  # the inode of what is read, not of a path
                    inode = os.fstat(handle.fileno()).st_ino
                    body = json.loads(handle.read())
                if body.get("server") != self._server:
                    continue
                found.append(OutboxEntry(path, result_from_json(body["result"]), float(body["saved_at"]),
                                         int(body.get("poll_count") or 0), inode))
            except FileNotFoundError:  # delivered by another runner of this state directory meanwhile
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping unreadable saved result %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
        return sorted(found, key=lambda e: e.saved_at)

    def deliver(
        self,
        update: Callable[[TaskResult], None],
        *,
        stop: Callable[[], bool] = lambda: False,
        read_task: Callable[[str], TaskOwnership | None] | None = None,
        quiet: bool = False,
        delivered: Callable[[OutboxEntry], None] | None = None,
    ) -> DeliveryReport:
        """Send every saved result with ``update``; keeps them only while the server is unreachable.

        ``stop()`` is asked before each result: True keeps the rest for the next start (a signal).
        ``read_task(task_id)`` (``ConductorClient.get_task_ownership``; None: 404) is asked before
        each delivery: a task no longer ours is dropped with one log line saying why. None: no check.
        ``quiet``: a server still unreachable is logged at debug level (a retry every few seconds).
        ``delivered(entry)``: called after each delivery (the runner reads it back if a late heartbeat
        may still undo it: docs/final-results.md); what it raises is logged, never lost results.
        """
        sent = dropped = kept = 0
        now = self._clock.now().timestamp()
        self._recover_claims()
        pending = self.entries()
        if pending:  # the redelivery rules: loaded when there is something to deliver (start-up CPU)
            from leasecore.state.redelivery import Done, Drop, KeepRest, Send, after_failure, before_send
        for i, entry in enumerate(pending):
            if stop():
                kept = len(pending) - i
                break
            claimed: Path | None = None
            failed: ConductorError | None = None
            age = now - entry.saved_at
            try:
                lost = None
                if read_task is not None and age <= self.max_age_seconds:  # too old: dropped unread
                    lost = saved_result_lost_reason(read_task(entry.result.task_id), entry.poll_count,
                                                    entry.result)
                fate: Fate = before_send(age_seconds=age, max_age_seconds=self.max_age_seconds, not_ours=lost)
                if isinstance(fate, Send):
                    claimed = entry.claim(self._owner)
                    if claimed is None:  # another runner of this directory sends it (or a newer one came)
                        continue
                    update(entry.result)
                    fate = Done()
            except ConductorError as exc:
                decision = decide(failure_of(exc), Attempt(
                    entry.result.status, saved=True, status_code=exc.status_code,
                    has_body=bool(entry.result.output_data or entry.result.logs)))
                fate = after_failure(decision, sent=claimed is not None)
                if isinstance(fate, KeepRest):  # unreachable, or our credentials: keep it all for next time
                    if claimed is not None:
                        _put_back(claimed, entry.path)
                    quiet_now = quiet and not isinstance(exc, ConductorAuthError)
                    log.log(logging.DEBUG if quiet_now else logging.WARNING, "could not deliver %d saved "
                            "result(s) yet: %s", len(pending) - i, exc)  # fmt: skip
                    kept = len(pending) - i
                    break
                failed = exc
            except BaseException:  # a bug or a signal: the result stays for a later delivery
                if claimed is not None:
                    _put_back(claimed, entry.path)
                raise
            if isinstance(fate, Drop):
                dropped += 1
                self._drop(entry, claimed, fate, update, failed)
            elif isinstance(fate, Done):
                sent += 1
                self._delivered(entry, claimed, delivered)
        return DeliveryReport(sent, dropped, kept)

    def _drop(self, entry: OutboxEntry, claimed: Path | None, fate: Drop,
              update: Callable[[TaskResult], None], failed: ConductorError | None) -> None:  # fmt: skip
        result = entry.result
        log.warning("dropping the saved result of task %s (%s): %s%s", result.task_id, result.status.value,
                    fate.why, f": {failed}" if failed is not None else "")  # fmt: skip
        if fate.bare is not None:
            self._send_bare(update, result, fate.bare, str(failed or fate.why))
        if claimed is not None:
            claimed.unlink(missing_ok=True)
        else:
            entry.forget()

    @staticmethod
    def _delivered(entry: OutboxEntry, claimed: Path | None,
                   after: Callable[[OutboxEntry], None] | None) -> None:  # fmt: skip
        if claimed is not None:
            claimed.unlink(missing_ok=True)
        result = entry.result
        log.info("delivered the saved result of task %s (%s)", result.task_id, result.status.value)
        if after is not None:
            try:
                after(entry)
            except Exception:  # it was delivered: a failed read-back loses nothing
                log.exception("task %s: reading the delivered result back failed", entry.result.task_id)

    @staticmethod
    def _send_bare(update: Callable[[TaskResult], None], result: TaskResult, status: TaskStatus,
                   why: str) -> None:  # fmt: skip
        """The task FAILED without the body the server refused, once (``finalfailure.SendBare``): the
        server retries it now rather than after its response timeout. Refused too: nothing more."""
        try:
            update(bare_result(result, status, why[:200]))
        except ConductorError as again:
            log.warning("task %s: the server refused a bare %s too: %s", result.task_id, status.value, again)
            return
        log.warning("task %s: reported %s without its output instead", result.task_id, status.value)
