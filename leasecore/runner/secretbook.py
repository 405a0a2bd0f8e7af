"""What the runner knows to be secret, and the runner's own log kept free of it.

Owns ``SecretBook``: the values every task type masks (the runner's credentials, the values of the
variables named in ``secrets`` and by the credential patterns: ``static_values``) plus, while a task
is here, its runtime metadata's values (``enter`` / ``leave``, counted: tasks of one type usually
share theirs). ``masker()`` is the union, rebuilt only when a value comes or goes; ``LogMasking`` is
a ``logging.Filter`` that masks each record's message (and its traceback) with it, installed on the
handlers of the project's loggers for the run (``installed``).

Must not: decide anything about a task (the runner asks ``for_task``), or keep a value after the
last task that brought it left. Threads: ``enter``/``leave`` on the runner's main thread; the filter
on any thread that logs (it reads one reference, swapped whole: no lock on the logging path).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from leasecore.masking import Masker, masked_names
from leasecore.process.spec import is_secret_name


def static_values(
    environ: Mapping[str, str], env_table: Mapping[str, str], patterns: Iterable[str],
    credentials: Iterable[str | None],
) -> list[str]:
    """The values a task type masks whatever the task: ``credentials`` (the runner's key, secret and
    token), and the values of the variables of ``environ`` and ``env_table`` kept from the child
    (the credential patterns and ``patterns``, the task's ``secrets``)."""
    extra = tuple(patterns)
    values = [value for value in credentials if value]
    for source in (environ, env_table):
        values.extend(value for name, value in source.items() if value and is_secret_name(name, extra))
    return values


class SecretBook:
    """The values the runner masks now (see the module docstring)."""

    def __init__(self, static: Iterable[str] = ()) -> None:
        self._static = Masker.of(static)
        self._counts: Counter[bytes] = Counter()  # UTF-8 values, as a Masker keeps them
        self._owners: dict[str, tuple[bytes, ...]] = {}  # the tasks held, and the values each entered
        self._lock = threading.Lock()
        self._masker = self._static
        self._short_seen: set[tuple[str, str]] = set()  # (task type, name) warned of (bounded by the defs)

    def masker(self) -> Masker:
        return self._masker

    def for_task(self, base: Masker, metadata: Mapping[str, str]) -> Masker:
        """A task's masker: its type's ``base`` plus its runtime metadata's values."""
        return base.with_values(metadata.values()) if metadata else base

    def too_short(self, task_type: str, metadata: Mapping[str, str]) -> list[str]:
        """The names of ``metadata`` whose value is too short to mask, not reported before for
        ``task_type`` (for one warning each, by name; the value is never shown)."""
        new = [name for name in masked_names(metadata) if (task_type, name) not in self._short_seen]
        self._short_seen.update((task_type, name) for name in new)
        return new

    def enter(self, owner: str, values: Iterable[str]) -> None:
        """``owner``'s values (a task's) are masked in the runner's log from now on, until its
        ``leave``: the values it entered with, whatever its task holds by then."""
        kept = tuple(Masker.of(values)._values) if values else ()  # what a masker would keep counts
        if not kept and owner not in self._owners:  # the usual task: nothing to count
            return
        with self._lock:
            earlier = self._owners.pop(owner, ())
            if kept:
                self._owners[owner] = kept
        self._change(earlier, -1)
        self._change(kept, 1)

    def leave(self, owner: str) -> None:
        if owner not in self._owners:  # the usual task: it entered nothing (owners change on the main thread)
            return
        with self._lock:
            values = self._owners.pop(owner, ())
        self._change(values, -1)

    def _change(self, kept: Iterable[bytes], step: int) -> None:
        if not kept:
            return
        with self._lock:
            changed = False
            for value in kept:
                count = self._counts[value] + step
                if count <= 0:
                    changed |= self._counts.pop(value, 0) > 0
                else:
                    changed |= value not in self._counts
                    self._counts[value] = count
            if changed:
                self._masker = self._static.with_values(self._counts)


class LogMasking(logging.Filter):
    """Masks every record that reaches a handler it is on: the message (formatted once, here) and
    the traceback, with the book's current masker. Never drops a record."""

    def __init__(self, book: SecretBook) -> None:
        super().__init__()
        self._book = book

    def filter(self, record: logging.LogRecord) -> bool:
        masker = self._book.masker()
        if not masker:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format: leave it to the handler's own error report
            return True
        record.msg, record.args = masker.mask(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = masker.mask(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = masker.mask(record.exc_text)
        if record.stack_info:
            record.stack_info = masker.mask(record.stack_info)
        return True


@contextlib.contextmanager
def installed(
    book: SecretBook, logger_names: Iterable[str] = ("conductor_run", "leasecore", "")
) -> Iterator[None]:
    """``LogMasking`` on every handler of ``logger_names`` ("" = the root) for the ``with`` block."""
    log_filter = LogMasking(book)
    handlers = {h for name in logger_names for h in logging.getLogger(name or None).handlers}
    for handler in handlers:
        handler.addFilter(log_filter)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(log_filter)
