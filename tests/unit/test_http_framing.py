"""The one set of HTTP/1.1 body framing rules (leasecore.http_framing), shared by the embedded server
and the lean client transport: which header fields delimit a body, and the chunked parser, on bytes
in memory. Each side's own tests (test_server_framing, test_lean_http) send the same refusals over
real sockets."""

from __future__ import annotations

import io

import pytest

from leasecore.http_framing import (
    CHUNKED,
    MAX_CHUNK_LINE,
    MAX_TRAILER_LINES,
    BodyTooLarge,
    FramingError,
    body_length,
    read_chunked,
)


@pytest.mark.parametrize(
    ("codings", "lengths", "expected"),
    [
        ([], [], None),
        ([], ["12"], 12),
        ([], ["12", "12"], 12),  # repeated, equal: one length
        ([], ["12, 12"], 12),
        (["chunked"], [], CHUNKED),
        (["Chunked "], [], CHUNKED),
    ],
)
def test_the_length_a_body_announces(codings: list[str], lengths: list[str], expected: int | None) -> None:
    assert body_length(codings, lengths, 100) == expected


@pytest.mark.parametrize(
    ("codings", "lengths", "status"),
    [
        (["gzip, chunked"], [], 501),  # nobody here decodes gzip: never read it as plain chunked
        (["gzip", "chunked"], [], 501),
        (["chunked, chunked"], [], 501),
        (["gzip"], [], 501),
        (["chunked"], ["5"], 400),  # the request-smuggling shape
        ([], ["1", "2"], 400),
        ([], ["1, 2"], 400),
        ([], ["+2"], 400),
        ([], ["-1"], 400),
        ([], ["two"], 400),
        ([], ["1" * 20], 400),
        ([], ["101"], 413),
    ],
)
def test_ambiguous_or_oversized_framing_is_refused(
    codings: list[str], lengths: list[str], status: int
) -> None:
    with pytest.raises(FramingError) as info:
        body_length(codings, lengths, 100)
    assert info.value.status == status
    assert isinstance(info.value, BodyTooLarge) is (status == 413)


def chunked(data: bytes, max_bytes: int = 1 << 20) -> bytes:
    stream = io.BytesIO(data)
    return read_chunked(lambda limit: stream.readline(limit + 1), stream.read, max_bytes)


def test_a_chunked_body_with_extensions_and_trailers() -> None:
    assert chunked(b"3;ext=1\r\nabc\r\nA\r\n0123456789\r\n0\r\nX-Trailer: y\r\n\r\nNEXT") == b"abc0123456789"


def test_the_limits_are_the_servers() -> None:
    assert (MAX_CHUNK_LINE, MAX_TRAILER_LINES) == (4096, 64)
    longest = b"3;" + b"x" * (MAX_CHUNK_LINE - 3) + b"\r\nabc\r\n0\r\n\r\n"  # 4095 bytes + CRLF
    assert chunked(longest) == b"abc"
    assert chunked(b"0\r\n" + b"T: x\r\n" * (MAX_TRAILER_LINES - 1) + b"\r\n") == b""


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"zz\r\nxx\r\n0\r\n\r\n", 400),
        (b"-5\r\n", 400),
        (b"\r\n", 400),
        (b"0" * 17 + b"1\r\nx\r\n0\r\n\r\n", 400),
        (b"1;" + b"x" * MAX_CHUNK_LINE + b"\r\nx\r\n0\r\n\r\n", 400),
        (b"3\r\nabcXY0\r\n\r\n", 400),
        (b"3\r\nab", 400),  # cut short (a socket reader raises its own error first)
        (b"0\r\n" + b"T: x\r\n" * MAX_TRAILER_LINES + b"\r\n", 400),
        (b"0\r\nT: x", 400),
        (b"8\r\n01234567\r\n8\r\n01234567\r\n0\r\n\r\n", 413),
    ],
    ids=[
        "not-hex", "negative", "empty-size", "over-16-digits", "line-over-4-KiB",
        "chunk-longer-than-its-size", "cut", "over-64-trailers", "cut-trailer", "over-the-limit",
    ],
)
def test_a_malformed_chunked_body_is_refused(data: bytes, status: int) -> None:
    with pytest.raises(FramingError) as info:
        chunked(data, max_bytes=10)
    assert info.value.status == status
