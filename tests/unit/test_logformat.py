"""The runner's log formats (``cli.logformat``) write exactly what the logging module's own formatter
writes with the same format string, in UTC, across second boundaries and with tracebacks, although
they make the seconds' text once a second and put the plain line together directly."""

from __future__ import annotations

import json
import logging
import random
import sys
import time

from cli.logformat import PLAIN_FORMAT, TIME_FORMAT, JsonFormatter, PlainFormatter


def _stdlib_plain() -> logging.Formatter:
    formatter = logging.Formatter(PLAIN_FORMAT, TIME_FORMAT)
    formatter.converter = time.gmtime
    return formatter


def _record(created: float, level: int = logging.INFO, msg: str = "task %s: child exited; reporting %s",
            args: tuple[object, ...] = ("t-1", "COMPLETED"), exc_info: object = None) -> logging.LogRecord:
    record = logging.LogRecord("conductor_run.runner", level, __file__, 1, msg, args, exc_info)  # type: ignore[arg-type]
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0  # as LogRecord makes it
    return record


def test_plain_lines_are_the_stdlib_formatters_byte_for_byte() -> None:
    stdlib, ours = _stdlib_plain(), PlainFormatter()
    rng = random.Random(7)
    times = [1_700_000_000 + i * 0.0173 for i in range(3000)]  # many records a second, then the next
    times += [1_700_000_000 + rng.random() * 86_400 * 400 for _ in range(3000)]  # jumps, back and forth
    times += [1_700_000_000.9999, 1_700_000_001.0, 1_700_000_000.0005]
    for created in times:
        level = rng.choice([logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL])
        expected = stdlib.format(_record(created, level))
        assert ours.format(_record(created, level)) == expected
    line = "2023-11-14T22:13:20.250Z INFO    task t-1: child exited; reporting COMPLETED"
    assert ours.format(_record(1_700_000_000.25)) == line


def test_plain_lines_with_a_traceback_or_an_odd_message_are_the_stdlib_formatters() -> None:
    stdlib, ours = _stdlib_plain(), PlainFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    cases: list[dict[str, object]] = [{"level": logging.ERROR, "exc_info": exc_info},
                                      {"msg": "100% done, no args", "args": ()},
                                      {"msg": "ünïcödé %s", "args": ("✓",)}]
    for case in cases:
        expected = stdlib.format(_record(1_700_000_000.5, **case))  # type: ignore[arg-type]
        assert ours.format(_record(1_700_000_000.5, **case)) == expected  # type: ignore[arg-type]
    assert "ValueError: boom" in ours.format(_record(1_700_000_000.5, logging.ERROR, exc_info=exc_info))


def test_a_time_asked_in_another_format_or_zone_is_not_the_kept_text() -> None:
    ours = PlainFormatter()
    record = _record(1_700_000_000.5)
    assert ours.formatTime(record, TIME_FORMAT) == "2023-11-14T22:13:20"
    assert ours.formatTime(record, "%H:%M") == "22:13"  # another format: made, not the kept second
    assert ours.formatTime(record) == "2023-11-14 22:13:20,500"  # the logging module's default
    ours.converter = lambda t: time.gmtime((t or 0) + 3600)
    assert ours.formatTime(record, TIME_FORMAT) == "2023-11-14T23:13:20"


def test_json_lines_are_the_earlier_formatters() -> None:
    stdlib = logging.Formatter()
    stdlib.converter = time.gmtime
    ours = JsonFormatter()
    for created in (1_700_000_000 + i * 0.37 for i in range(500)):
        body = json.loads(ours.format(_record(created, logging.WARNING)))
        record = _record(created)
        expected_time = stdlib.formatTime(record, TIME_FORMAT) + f".{int(record.msecs):03d}Z"
        assert body == {"time": expected_time, "level": "warning", "logger": "conductor_run.runner",
                        "message": "task t-1: child exited; reporting COMPLETED"}
