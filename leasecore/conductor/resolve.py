"""Host name resolution bounded by a deadline, for the lean transport's connects.

Owns: :class:`BoundedResolver`. ``getaddrinfo`` blocks in C with no timeout of its own (a dead DNS
server holds it for the resolver's retries, often 10-30 s), so ``socket.create_connection`` cannot
keep an attempt inside its budget; here the lookup runs on a helper thread and the caller waits at
most what is left of the attempt (``ResolveTimeout``); a literal IP address is never looked up. A
name has at most one lookup in flight, which every caller waiting for it shares, so a hung resolver
costs one parked thread per name, not one per attempt.

Must not: cache answers (the system resolver or nscd may: one connect = one lookup), connect.
Threads: the callers' (any number) plus one short-lived daemon thread per lookup in flight.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["AddrInfo", "BoundedResolver", "ResolveTimeout"]

AddrInfo = tuple[Any, ...]  # one getaddrinfo entry: (family, type, proto, canonname, sockaddr)
GetAddrInfo = Callable[..., Sequence[AddrInfo]]


class ResolveTimeout(TimeoutError):
    """The host name did not resolve before the attempt's deadline."""


class _Lookup:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Sequence[AddrInfo] = ()
        self.error: BaseException | None = None


class BoundedResolver:
    """``resolve(host, port, timeout)`` -> getaddrinfo's entries for a TCP connect, within ``timeout``."""

    def __init__(self, getaddrinfo: GetAddrInfo | None = None) -> None:
        self._getaddrinfo = getaddrinfo or socket.getaddrinfo
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _Lookup] = {}

    def resolve(self, host: str, port: int, timeout_seconds: float) -> Sequence[AddrInfo]:
        """Raises :class:`ResolveTimeout` when the lookup takes longer than ``timeout_seconds``, and
        ``socket.gaierror`` (an ``OSError``) when the name does not resolve."""
        literal = _literal(host)
        if literal is not None:
            family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
        key = (host, port)
        with self._lock:
            lookup = self._pending.get(key)
            if lookup is None:
                lookup = self._pending[key] = _Lookup()
                threading.Thread(
                    target=self._run, args=(key, lookup), name=f"resolve {host}", daemon=True
                ).start()
        if not lookup.done.wait(max(0.0, timeout_seconds)):
            raise ResolveTimeout(f"cannot resolve {host!r} within {timeout_seconds:.2f} s")
        if lookup.error is not None:
            raise lookup.error
        return lookup.result

    def _run(self, key: tuple[str, int], lookup: _Lookup) -> None:
        try:
            lookup.result = self._getaddrinfo(key[0], key[1], 0, socket.SOCK_STREAM)
        except BaseException as exc:  # handed to every waiter; a thread has no one else to tell
            lookup.error = exc
        finally:
            with self._lock:
                self._pending.pop(key, None)
            lookup.done.set()


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 scope id (fe80::1%eth0) too
    except ValueError:
        return None
