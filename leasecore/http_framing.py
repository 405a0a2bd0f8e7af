"""HTTP/1.1 body framing, one set of rules for both ends: the embedded server reading a request and
the lean client transport reading an answer (RFC 9112 §6, §7.1).

Owns: which header fields delimit a body (:func:`body_length`), the ``chunked`` parser
(:func:`read_chunked`), and the bounds on both. Pure: no sockets, no threads; a caller hands in the
header values it received and reader callables over its own buffer. Does not own: header parsing,
timeouts, what an error means to the caller (the server answers ``FramingError.status`` and closes the
connection; the client raises it as a :class:`~leasecore.errors.ConductorProtocolError`).

Anything ambiguous is refused rather than guessed, because a wrong guess leaves part of a body on the
connection to be read as the next message: a transfer coding other than exactly ``chunked`` (``gzip,
chunked`` included: nobody here decodes gzip), Content-Length together with Transfer-Encoding (the
request-smuggling shape), conflicting or malformed Content-Length values, a bad chunk size, chunk data
that does not end where its size says, an over-long chunk line, too many trailer lines.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

__all__ = [
    "CHUNKED",
    "MAX_CHUNK_LINE",
    "MAX_TRAILER_LINES",
    "BodyTooLarge",
    "FramingError",
    "body_length",
    "read_chunked",
]

CHUNKED = -1  # body_length's answer for a chunked body
MAX_CHUNK_LINE = 4096  # one chunk-size or trailer line
MAX_TRAILER_LINES = 64
_DIGITS = re.compile(r"[0-9]{1,19}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class FramingError(ValueError):
    """A body that cannot be delimited. ``status``: what a server answers for it (400, 413 or 501).

    ``answer_status``: set by a client reading an answer, the status line that came before the body.
    """

    answer_status: int | None = None

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class BodyTooLarge(FramingError):
    """The body is larger than the reader's limit."""

    def __init__(self, max_bytes: int, what: str = "body") -> None:
        super().__init__(413, f"{what} larger than {max_bytes} bytes")


def body_length(
    transfer_encodings: Iterable[str], content_lengths: Iterable[str], max_bytes: int, *, what: str = "body"
) -> int | None:
    """The length the header fields announce: bytes, :data:`CHUNKED`, or ``None`` when neither field
    is present (a request then has no body; an answer runs to the end of the connection).

    ``transfer_encodings``/``content_lengths``: every value of that field as received (repeated fields
    and comma-separated lists alike). Raises :class:`FramingError` / :class:`BodyTooLarge`.
    """
    codings = [c.strip().lower() for value in transfer_encodings for c in value.split(",") if c.strip()]
    lengths = {v.strip() for value in content_lengths for v in value.split(",")}
    if codings:
        if codings != ["chunked"]:
            raise FramingError(501, f"Transfer-Encoding {', '.join(codings)[:60]!r} is not supported")
        if lengths:
            raise FramingError(400, "Both Content-Length and Transfer-Encoding: refused")
        return CHUNKED
    if not lengths:
        return None
    if len(lengths) != 1:
        raise FramingError(400, "Conflicting Content-Length values")
    (value,) = lengths
    if not _DIGITS.fullmatch(value):
        raise FramingError(400, f"Invalid Content-Length {value[:40]!r}")
    length = int(value)
    if length > max_bytes:
        raise BodyTooLarge(max_bytes, what)
    return length


def read_chunked(
    read_line: Callable[[int], bytes],
    read_exact: Callable[[int], bytes],
    max_bytes: int,
    *,
    what: str = "body",
) -> bytes:
    """A ``chunked`` body, read through its last line (chunk extensions and trailers discarded).

    ``read_line(limit)``: the next line with its line ending, at most ``limit + 1`` bytes in all (a
    result without ``\\n`` means longer, or cut short). ``read_exact(n)``: the next ``n`` bytes (fewer
    only when the input ended). Either may raise its own error for a connection that ends or stalls.
    """
    chunks: list[bytes] = []
    total = 0
    while True:
        size_text = _line(read_line).split(b";", 1)[0].strip()
        if not _HEX.fullmatch(size_text):
            raise FramingError(400, f"Malformed chunked body (bad chunk size {size_text[:20]!r})")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > max_bytes:
            raise BodyTooLarge(max_bytes, what)
        data = read_exact(size)
        if len(data) != size or read_exact(2) != b"\r\n":
            raise FramingError(400, "Malformed chunked body (chunk data does not match its size)")
        chunks.append(data)
    for _ in range(MAX_TRAILER_LINES):
        if _line(read_line) == b"":
            return b"".join(chunks)
    raise FramingError(400, f"Malformed chunked body (more than {MAX_TRAILER_LINES} trailer lines)")


def _line(read_line: Callable[[int], bytes]) -> bytes:
    line = read_line(MAX_CHUNK_LINE)
    if not line.endswith(b"\n"):
        raise FramingError(400, "Malformed chunked body (line too long or cut short)")
    return line.rstrip(b"\r\n")
