"""``EmbeddedServer``: the in-memory Conductor-compatible server, started in-process on a loopback port.

Not for production: it keeps everything in memory and implements only what a worker and a test harness
use (CONDUCTOR_PROTOCOL.md §12)::

    with EmbeddedServer() as srv:          # port 0: a free port
        client = ConductorClient(srv.url)  # "http://127.0.0.1:PORT/api"

Owns: the lifecycle (listen, start, stop: the listener closed and every kept-alive connection cut)
of the parts it joins: the ``Store`` (state and decider; ``store=`` hands in a fresh one, e.g. a
recording subclass, whose clock, sweep mode and bounds then apply), the ``Api`` (``server.api``) and
the socket layer (``server.httpd``). Memory is bounded: ``max_finished_workflows`` (the oldest
finished is forgotten first, with its tasks and logs; running ones never) and ``max_logs_per_task``.

Must not: route or keep state itself. Threads: the caller's for start/stop; ``serve_forever`` and
the store's timer loop on two daemon threads of its own, plus the HTTP server's one per connection.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Mapping
from types import TracebackType

from leasecore.clock import Clock
from leasecore.errors import ConfigError
from leasecore.server.http.api import Api
from leasecore.server.http.httpd import ApiHTTPServer
from leasecore.server.store import Store, SweepMode
from leasecore.server.storestate import DEFAULT_MAX_FINISHED_WORKFLOWS, DEFAULT_MAX_LOGS_PER_TASK

# A wildcard bind address, and the loopback address a client on this host reaches it through.
_WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class EmbeddedServer:
    """An embedded Conductor-compatible server; ``start()`` returns once it is listening."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        auth_key: str | None = None,
        auth_secret: str | None = None,
        token_ttl_seconds: float = 3600,
        sweep_mode: SweepMode = "ideal",
        clock: Clock | None = None,
        log: Callable[[str], None] | None = None,
        max_finished_workflows: int = DEFAULT_MAX_FINISHED_WORKFLOWS,
        max_logs_per_task: int = DEFAULT_MAX_LOGS_PER_TASK,
        store: Store | None = None,
        runtime_environ: Mapping[str, str] | None = None,
    ) -> None:
        """``runtime_environ``: where polled tasks' runtimeMetadata is resolved from
        (``CONDUCTOR_SECRET_<NAME>``, then ``CONDUCTOR_ENV_<NAME>``; default: this process's environment)."""
        self.host = host
        self._requested_port = port
        self.store = (
            store
            if store is not None
            else Store(
                clock=clock,
                sweep_mode=sweep_mode,
                max_finished_workflows=max_finished_workflows,
                max_logs_per_task=max_logs_per_task,
            )
        )
        if runtime_environ is not None:
            self.store.runtime_environ = dict(runtime_environ)
        self.api = Api(
            self.store, auth_key=auth_key, auth_secret=auth_secret, token_ttl_seconds=token_ttl_seconds
        )
        self._log = log
        self._httpd: ApiHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> EmbeddedServer:
        """Bind and start serving; raises ConfigError when the address cannot be bound."""
        if self._httpd is not None:
            return self
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            httpd = ApiHTTPServer((self.host, self._requested_port), self.api, self._log, family)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc.strerror or exc}", key="port"
            ) from exc
        self._httpd = httpd
        self._threads = [
            threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.5},
                name="embedded-conductor-http",
                daemon=True,
            ),
            threading.Thread(target=self.store.timer_loop, name="embedded-conductor-timer", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop serving: wake long polls, close the listener and every open connection."""
        httpd = self._httpd
        if httpd is None:
            return
        self._httpd = None
        self.store.close()
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ facts

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        return int(self._httpd.server_address[1])

    @property
    def every_interface(self) -> bool:
        """Whether it is bound to a wildcard address: reachable from beyond this host."""
        return self.host in _WILDCARD_LOOPBACK

    @property
    def url(self) -> str:
        """Base URL of the API, ``http://HOST:PORT/api`` (a wildcard host is reached via loopback)."""
        host = _WILDCARD_LOOPBACK.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/api"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    @property
    def open_connections(self) -> int:
        """Client connections being served right now (0 when stopped)."""
        return self._httpd.open_connections if self._httpd is not None else 0

    # ------------------------------------------------------------------------------------ test hooks

    def expire_tokens(self) -> None:
        """Expire every token issued so far: the next call with one gets 401 EXPIRED_TOKEN."""
        self.api.expire_tokens()

    def wake(self) -> None:
        """Re-evaluate timers and long polls now (after moving an injected fake clock)."""
        self.store.wake()
