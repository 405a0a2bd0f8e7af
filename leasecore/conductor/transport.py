"""The Conductor client's transport seam: one :class:`Transport` protocol, two implementations, and the
one place that picks between them (:func:`open_transport`).

Owns: the protocol (``send(method, target, body, headers, deadline, *, idempotent, generation)``,
``abort``, ``close``, ``connections_opened``, ``generation``) and the choice:
:class:`~leasecore.conductor.lean.LeanTransport` for ``http://`` without a proxy for the host (the
runner's hot path: the fewest system calls and the least CPU);
:class:`~leasecore.conductor.requests_transport.RequestsTransport` for anything else (``https://``, a proxy
from the environment, a caller's own session), imported only when chosen (a lean start). Both frame answers
by the rules of :mod:`leasecore.http_framing`, bound a whole exchange by one deadline, and raise
library errors only; the client translates them once (``conductor.calls.translate_errors``).

Must not: retry (the lean transport's one resend of an idempotent call on a dead kept-alive
connection is its own), translate errors, or import requests at module level.
Threads: any; one transport is shared by every thread of a client.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from leasecore.conductor.lean import LeanTransport

if TYPE_CHECKING:  # requests is imported only when the lean transport does not serve
    import requests

    from leasecore.conductor.requests_transport import RequestsTransport

__all__ = ["RequestsTransport", "Transport", "open_transport"]


def __getattr__(name: str) -> Any:
    if name == "RequestsTransport":  # defined with the rest of the requests side, loaded on first use
        from leasecore.conductor.requests_transport import RequestsTransport

        return RequestsTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        """Cut every call in flight now (a forced stop): a call blocked on a silent server fails
        at once instead of at its deadline. Later calls go on as usual (the caller bounds them).
        Thread-safe; idempotent."""
        ...

    def close(self) -> None:
        """Release pooled connections; a call in flight finishes on its own connection."""
        ...


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
    if session is None and parts.scheme == "http" and not _environ_proxies(base_url):
        return LeanTransport(
            parts.hostname or "",
            parts.port or 80,
            max_idle=pool_maxsize,
            monotonic=monotonic,
            max_body_bytes=max_body_bytes,
        )
    # https, a proxy, a session: requests
    from leasecore.conductor.requests_transport import RequestsTransport

    return RequestsTransport(
        f"{parts.scheme}://{parts.netloc}",
        session=session,
        verify=verify,
        pool_maxsize=pool_maxsize,
        max_body_bytes=max_body_bytes,
        monotonic=monotonic,
    )


def _environ_proxies(url: str) -> bool:
    """Whether requests would send calls to ``url`` through a proxy from the environment.

    On POSIX, requests (urllib's ``getproxies``) reads only ``*_proxy`` variables (any case): with none
    but ``no_proxy`` set there is no proxy, and requests need not be imported to say so (it is
    about 10 MB of a runner's RSS); otherwise requests' own reading decides (``no_proxy`` patterns,
    CGI's ``HTTP_PROXY`` rule)."""
    if os.name == "posix" and not any(
        name.lower().endswith("_proxy") and name.lower() != "no_proxy" and value
        for name, value in os.environ.items()
    ):
        return False
    from leasecore.conductor import requests_transport as conductor_requests
    return bool(conductor_requests.environ_proxies(url))
