"""A loopback TCP relay that can fall silent: the demo's "the server stops answering" switch.

    with SilenceProxy("127.0.0.1", server_port) as proxy:
        client = ConductorClient(proxy.url_for("/api"))
        proxy.silence()     # connections stay open, but not one byte moves either way
        proxy.resume()      # everything held back flows again

Silence is what a network partition looks like to a worker: connects still succeed (the kernel
accepts them) but requests get no answer, so every call ends in the client's own timeout. Nothing is
dropped: bytes wait in the socket buffers and move on ``resume()``. One thread accepts; one thread per
connection relays both directions with ``select``. ``stop()`` closes every socket and joins every thread.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from types import TracebackType

__all__ = ["SilenceProxy"]

_TICK_SECONDS = 0.05  # how often idle threads notice silence(), resume() or stop()
_CHUNK_BYTES = 64 * 1024
_CONNECT_TIMEOUT_SECONDS = 5.0


class SilenceProxy:
    """Relay 127.0.0.1:<port> to ``target_host:target_port``; ``silence()`` stops all traffic."""

    def __init__(self, target_host: str, target_port: int, *, max_connections: int = 64) -> None:
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self._flowing = threading.Event()
        self._flowing.set()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.accepted = 0  # connections accepted so far

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> SilenceProxy:
        if self._listener is not None:
            return self
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(_TICK_SECONDS)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._spawn(self._accept_loop, "silenceproxy-accept")
        return self

    def stop(self) -> None:
        """Close the listener and every connection; join every thread."""
        self._stopping.set()
        self._flowing.set()
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            sock.close()
        if self._listener is not None:
            self._listener.close()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
                self._threads.clear()
            if not threads:
                break
            for t in threads:
                t.join(timeout=5)

    def __enter__(self) -> SilenceProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- control ----------------------------------------------------------------------------------

    def url_for(self, path: str = "") -> str:
        """``http://127.0.0.1:PORT{path}``."""
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def silent(self) -> bool:
        return not self._flowing.is_set()

    def silence(self) -> None:
        """From now on nothing is read or forwarded, on old or new connections."""
        self._flowing.clear()

    def resume(self) -> None:
        """Relay again, starting with whatever waited in the socket buffers."""
        self._flowing.set()

    # -- threads ----------------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        # Start under the lock: stop() must never see (and join) a thread that has not started yet.
        with self._lock:
            if self._stopping.is_set():
                return
            self._threads.add(thread)
            thread.start()

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                return False
            self._sockets.add(sock)
            return True

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._sockets.discard(sock)
        for sock in socks:
            sock.close()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed by stop()
            conn.settimeout(None)
            with self._lock:
                full = len(self._sockets) >= 2 * self.max_connections
            if full or not self._track(conn):
                conn.close()
                continue
            self.accepted += 1
            self._spawn(self._relay, "silenceproxy-relay", conn)

    def _relay(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            self._wait_until_flowing()
            if self._stopping.is_set():
                return
            upstream = socket.create_connection(self.target, timeout=_CONNECT_TIMEOUT_SECONDS)
            upstream.settimeout(None)
            if not self._track(upstream):
                upstream = None
                return
            peer = {client: upstream, upstream: client}
            while not self._stopping.is_set():
                if not self._flowing.is_set():
                    self._wait_until_flowing()
                    continue
                readable, _, _ = select.select(list(peer), [], [], _TICK_SECONDS)
                for sock in readable:
                    data = sock.recv(_CHUNK_BYTES)
                    if not data:
                        return  # one side closed: close both
                    peer[sock].sendall(data)
        except (OSError, ValueError):
            return  # a reset, a closed socket (stop()), or a refused upstream: the connection ends
        finally:
            self._forget(client, *([upstream] if upstream is not None else []))
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _wait_until_flowing(self) -> None:
        while not self._flowing.wait(_TICK_SECONDS) and not self._stopping.is_set():
            pass
