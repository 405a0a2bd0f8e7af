"""The Conductor client's transport seam: one :class:`Transport` protocol, two implementations, and the
one place that picks between them (:func:`open_transport`).

* :class:`~leasecore.conductor_lean.LeanTransport`: keep-alive HTTP/1.1 on a plain socket, for
  ``http://`` without a proxy (the runner's hot path: the fewest system calls and the least CPU);
* :class:`RequestsTransport`: ``requests`` (TLS, proxies from the environment, a caller's own session
  and adapters).

Both frame answers by the rules of :mod:`leasecore.http_framing` (the lean one with its parser, the
requests one by refusing the same ambiguous header fields before reading a body), bound a whole
exchange by one deadline, and raise library errors only (``OSError``, ``http.client``/``requests``/
``urllib3`` errors, :class:`~leasecore.http_framing.FramingError`): the client translates them once,
in :func:`leasecore.conductor_http.translate_errors`. Neither retries, except the lean transport's one
resend of an idempotent call whose kept-alive connection died under it (requests has no such resend:
its pool checks a connection before reuse, and a call that dies on one fails).

Threads: any; one transport is shared by every thread of a client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import requests
import requests.utils
from urllib3.util import Timeout as Urllib3Timeout

from leasecore.conductor_http import Connections, new_session
from leasecore.conductor_lean import LeanTransport
from leasecore.http_framing import BodyTooLarge, FramingError, body_length

__all__ = ["RequestsTransport", "Transport", "open_transport"]

_READ_CHUNK = 64 * 1024


class Transport(Protocol):
    """One HTTP exchange at a time per calling thread, thread-safe, bounded by ``deadline``."""

    @property
    def connections_opened(self) -> int | None:
        """Connections opened so far, where the transport counts them (``None``: it does not)."""
        ...

    @property
    def generation(self) -> int:
        """Aborts so far, where the transport counts them (0: it does not). A caller reads it when
        its call begins and passes it to :meth:`send`, so an abort in between cuts that call too."""
        ...

    def send(
        self,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool,
        generation: int | None = None,
    ) -> tuple[int, bytes]:
        """``target``: origin-form (``/api/tasks?x=1``). Returns (status, the whole body), read by
        ``deadline`` (the client's monotonic clock). ``idempotent``: the call may be sent twice.
        ``generation``: :attr:`generation` when the caller's call began (``None``: not tracked)."""
        ...

    def abort(self) -> None:
        """Cut every call in flight now (a forced stop, #24): a call blocked on a silent server fails
        at once instead of at its deadline. Later calls go on as usual (the caller bounds them).
        Thread-safe; idempotent."""
        ...

    def close(self) -> None:
        """Release pooled connections; a call in flight finishes on its own connection."""
        ...


class RequestsTransport:
    """A :class:`Transport` on a ``requests`` session: TLS, proxies, injected sessions and adapters."""

    def __init__(
        self,
        origin: str,
        *,
        session: requests.Session | None = None,
        verify: bool | str = True,
        pool_maxsize: int,
        max_body_bytes: int,
        monotonic: Callable[[], float],
    ) -> None:
        self._origin = origin
        self._owns_session = session is None
        self._connections = Connections()  # the owned session's live connections (abort cuts them)
        self._session = session or new_session(pool_maxsize, self._connections)
        # Per request, not session.verify: requests lets REQUESTS_CA_BUNDLE override a session's
        # setting, never a request's. An injected session keeps its own (None: the session decides).
        self._verify: bool | str | None = verify if session is None else None
        self._max_body_bytes = max_body_bytes
        self._monotonic = monotonic

    @property
    def connections_opened(self) -> int | None:
        return None  # urllib3's pool does not say

    @property
    def generation(self) -> int:
        return 0  # abort() cuts the connections themselves: no call needs to know its generation

    @property
    def session(self) -> requests.Session:
        return self._session

    @property
    def verify(self) -> bool | str | None:
        """What each request is told to verify TLS against (``None``: the injected session's own)."""
        return self._verify

    def abort(self) -> None:
        """Shut down the sockets of the session's live connections (#24), only of a session this
        transport created: an injected session's connections are its owner's."""
        if self._owns_session:
            self._connections.cut()

    def close(self) -> None:
        """Close the session's pools, only of a session this transport created."""
        if self._owns_session:
            self._session.close()

    def send(
        self,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool,
        generation: int | None = None,
    ) -> tuple[int, bytes]:
        remaining = deadline - self._monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        # urllib3's total timeout bounds connect + waiting for the answer together; the body is read
        # below against the same deadline, so no attempt outlives it by more than one socket read.
        timeout = cast(Any, Urllib3Timeout(total=remaining))
        response = self._session.request(
            method,
            self._origin + target,
            data=body,
            headers=dict(headers),
            timeout=timeout,
            stream=True,
            allow_redirects=False,
            verify=self._verify,
        )
        try:
            return response.status_code, self._read_body(response, method, deadline)
        except FramingError as exc:
            exc.answer_status = response.status_code
            raise
        finally:
            response.close()

    def _read_body(self, response: requests.Response, method: str, deadline: float) -> bytes:
        if method == "HEAD" or response.status_code in (204, 304):
            return b""
        # The framing rules of the lean transport and the server, on the fields http.client parsed
        # (it would read "gzip, chunked" to the end undecoded, and let chunked win over Content-Length).
        coding, length = response.headers.get("Transfer-Encoding"), response.headers.get("Content-Length")
        body_length(
            () if coding is None else (coding,),
            () if length is None else (length,),
            self._max_body_bytes,
            what="answer",
        )
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_content(chunk_size=_READ_CHUNK):
            chunks.append(chunk)
            size += len(chunk)
            if size > self._max_body_bytes:
                raise BodyTooLarge(self._max_body_bytes, "answer")
            if self._monotonic() > deadline:
                raise TimeoutError("timed out reading the answer")
        return b"".join(chunks)


def open_transport(
    base_url: str,
    *,
    session: requests.Session | None = None,
    verify: bool | str = True,
    pool_maxsize: int,
    max_body_bytes: int,
    monotonic: Callable[[], float],
) -> Transport:
    """The one place the transport is chosen: lean for plain ``http://`` with no proxy configured for
    the host (``HTTP_PROXY``/``NO_PROXY``) and no injected ``session``; requests for everything else.

    ``verify``: requests' TLS verification for a session made here (``True``, ``False``, or a CA
    bundle's path); it does not apply to plain HTTP, nor to an injected session (which has its own).
    """
    parts = urlsplit(base_url)
    if session is None and parts.scheme == "http" and not requests.utils.get_environ_proxies(base_url):
        return LeanTransport(
            parts.hostname or "",
            parts.port or 80,
            max_idle=pool_maxsize,
            monotonic=monotonic,
            max_body_bytes=max_body_bytes,
        )
    return RequestsTransport(
        f"{parts.scheme}://{parts.netloc}",
        session=session,
        verify=verify,
        pool_maxsize=pool_maxsize,
        max_body_bytes=max_body_bytes,
        monotonic=monotonic,
    )
