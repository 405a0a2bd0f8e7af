"""The runner's log line formats: plain text and JSON lines, both in UTC, the time's text made once a second.

A task writes two log lines (its start and its exit), on two threads; the logging module's own
``Formatter`` turns each record's time into text with ``time.gmtime`` and ``time.strftime`` and
fills the format through a dict of the record's fields. Here the seconds' text is kept until the
second changes and the plain line is put together directly: the same bytes, at a fraction of the
cost. A record with a traceback or stack goes through the logging module's own path unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["PLAIN_FORMAT", "TIME_FORMAT", "JsonFormatter", "PlainFormatter"]

TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
PLAIN_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(message)s"  # what PlainFormatter writes


class _SecondsText(logging.Formatter):
    """``formatTime`` in ``TIME_FORMAT`` through ``time.gmtime``, its text kept for the second it names."""

    def __init__(self, fmt: str | None = None) -> None:
        super().__init__(fmt, TIME_FORMAT)
        self.converter = time.gmtime  # UTC, as the trailing Z says
        # (whole second, its text), replaced whole: two threads may format at once (another handler)
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt != TIME_FORMAT or self.converter is not time.gmtime:  # not the kept text's kind
            return super().formatTime(record, datefmt)
        second = int(record.created)  # (gmtime rounds a positive time down, as int does)
        kept = self._second
        if kept[0] != second:
            kept = self._second = (second, time.strftime(TIME_FORMAT, time.gmtime(second)))
        return kept[1]


class PlainFormatter(_SecondsText):
    """``PLAIN_FORMAT`` with ``TIME_FORMAT``, in UTC: ``2026-12-05T11:30:57.123Z INFO    message``."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:  # the logging module's own path
            return super().format(record)
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, TIME_FORMAT)
        return f"{record.asctime}.{int(record.msecs):03d}Z {record.levelname:<7} {record.message}"


class JsonFormatter(_SecondsText):
    """One JSON object per line: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": f"{self.formatTime(record, TIME_FORMAT)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:  # the text a filter left (masked secrets, docs/secrets.md), else made here
            body["error"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)
