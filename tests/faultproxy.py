"""A loopback TCP proxy whose faults a test switches at runtime.

    with FaultProxy("127.0.0.1", server_port) as proxy:
        client = ConductorClient(proxy.url_for("/api"))
        proxy.set_mode(Mode.BLACKHOLE)          # connected, but nothing ever comes back
        proxy.set_mode(Mode.LATENCY, latency_seconds=0.5)
        proxy.set_mode(Mode.PASS)

Modes:
    PASS       forward both ways.
    REFUSE     new connections are closed at once (existing ones keep working).
    RESET      every connection, existing and new, is aborted with a TCP RST (SO_LINGER 0).
    BLACKHOLE  new connections are accepted but never forwarded or answered; existing ones stall
               (nothing is read or written) until the mode changes.
    LATENCY    forward, delaying every chunk by ``latency_seconds``.

Beside the modes, ``hold_heartbeats()`` holds the first heartbeat (an extendLease request) of each
task and lets it through together with that task's next other update (its final update): the held
request goes on to the server even after the client gave up on it and closed its connection, as a
congested network or a healing partition delivers what it already took (``held`` / ``released``).

``lose_answer(pattern)`` lets the first request whose bytes match ``pattern`` reach the server, holds
its answer for a moment, then resets the client's connection instead of answering (``lost``): the
update was applied, and its sender cannot know.

One thread accepts; one thread per connection pumps both directions with ``select``. Connections
are bounded (``max_connections``; extra ones are reset). Leaving the ``with`` block (or ``stop()``)
closes every socket and joins every thread.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import struct
import threading
from enum import StrEnum
from types import TracebackType

_TICK_SECONDS = 0.02  # how often idle threads notice a mode change or stop()
_CHUNK_BYTES = 64 * 1024


_LEASE_RE = re.compile(rb'"extendLease"\s*:\s*true')
_TASK_ID_RE = re.compile(rb'"taskId"\s*:\s*"([^"]+)"')
_UPDATE_RE = re.compile(rb"^POST [^ ]*/tasks(/update-v2)?(\?[^ ]*)? HTTP/1\.1\r\n")


class Mode(StrEnum):
    PASS = "pass"
    REFUSE = "refuse"
    RESET = "reset"
    BLACKHOLE = "blackhole"
    LATENCY = "latency"


def _abort(sock: socket.socket) -> None:
    """Close with RST instead of FIN."""
    # OSError: the socket is already closed; a plain close is all that is left.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class FaultProxy:
    """Listen on 127.0.0.1:0 and forward to ``target_host:target_port``, with switchable faults."""

    def __init__(self, target_host: str, target_port: int, *, max_connections: int = 64) -> None:
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_TICK_SECONDS * 5)
        self.host, self.port = self._listener.getsockname()[:2]
        self._mode = Mode.PASS
        self._latency_seconds = 0.0
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._sockets: set[socket.socket] = set()
        self.accepted = 0  # connections accepted since start, for assertions
        self._holding = False  # hold_heartbeats() is on
        self._hold_every = 1
        self._beating: set[str] = set()  # tasks whose first heartbeat was seen (held or not)
        self._held: dict[str, threading.Event] = {}  # task id -> released (one held beat per task)
        self._forwarded: dict[str, threading.Event] = {}  # task id -> its held beat went upstream
        self.held: list[str] = []  # task ids whose heartbeat was held, in order
        self.released: list[str] = []  # task ids whose held heartbeat went on with their final update
        self._lose: re.Pattern[bytes] | None = None  # lose_answer(): the request whose answer is lost
        self._lose_after = 0.0
        self.lost: list[str] = []  # task ids of the requests whose answer was lost
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        self._acceptor.start()

    # -- control ------------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    def url_for(self, path: str = "") -> str:
        """``http://127.0.0.1:PORT{path}``."""
        return f"http://{self.host}:{self.port}{path}"

    def set_mode(self, mode: Mode | str, *, latency_seconds: float = 0.0) -> None:
        """Switch the fault; connection threads notice within a few milliseconds."""
        mode = Mode(mode)
        if mode is Mode.LATENCY and latency_seconds <= 0:
            raise ValueError("LATENCY needs latency_seconds > 0")
        with self._changed:
            self._mode = mode
            self._latency_seconds = latency_seconds
            self._changed.notify_all()

    def hold_heartbeats(self, *, every: int = 1) -> None:
        """Hold each task's first heartbeat until that task's next other update (``POST /tasks`` or
        update-v2 without extendLease) comes through; then send the held heartbeat on and, once its
        bytes are out, the update. ``every``: only every n-th task whose first heartbeat passes (the
        others' heartbeats go through)."""
        with self._lock:
            self._holding = True
            self._hold_every = every

    def lose_answer(self, pattern: bytes, *, after_seconds: float = 0.0) -> None:
        """The first request (of a ``POST .../tasks``) matching ``pattern`` goes to the server; its
        answer is read, held ``after_seconds``, and dropped: the client's connection is reset."""
        with self._lock:
            self._lose = re.compile(pattern)
            self._lose_after = after_seconds

    def open_connections(self) -> int:
        """Connection threads still alive."""
        with self._lock:
            return sum(1 for t in self._threads if t.is_alive())

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Close every socket and join every thread."""
        self._stopping.set()
        with self._lock:
            for event in self._held.values():
                event.set()
        with self._changed:
            self._changed.notify_all()
        self._listener.close()
        self._acceptor.join(timeout_seconds)
        with self._lock:
            threads, sockets = list(self._threads), list(self._sockets)
        for sock in sockets:
            _abort(sock)
        for thread in threads:
            thread.join(timeout_seconds)
        leftover = [t.name for t in threads if t.is_alive()]
        if self._acceptor.is_alive() or leftover:
            raise RuntimeError(f"FaultProxy threads did not stop: {leftover}")

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- threads ------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed by stop()
            self.accepted += 1
            mode = self._mode
            if mode is Mode.REFUSE:
                client.close()
                continue
            if mode is Mode.RESET or self.open_connections() >= self.max_connections:
                _abort(client)
                continue
            thread = threading.Thread(
                target=self._serve, args=(client,), name=f"faultproxy-conn-{self.accepted}", daemon=True
            )
            with self._lock:
                self._sockets.add(client)
                self._threads = {t for t in self._threads if t.is_alive()}
                self._threads.add(thread)
            thread.start()

    def _wait_out_blackhole(self) -> Mode:
        """Block while the mode is BLACKHOLE (or until stop); return the mode that ended it."""
        with self._changed:
            while self._mode is Mode.BLACKHOLE and not self._stopping.is_set():
                self._changed.wait(_TICK_SECONDS * 5)
            return self._mode

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            if self._wait_out_blackhole() is Mode.RESET or self._stopping.is_set():
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
            except OSError:
                return
            with self._lock:
                self._sockets.add(upstream)
            self._pump(client, upstream)
        finally:
            self._close_pair(client, upstream)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        while not self._stopping.is_set():
            mode = self._wait_out_blackhole()
            if mode is Mode.RESET:
                _abort(client)
                _abort(upstream)
                return
            try:
                readable, _, _ = select.select(list(peers), [], [], _TICK_SECONDS)
            except (OSError, ValueError):
                return  # a socket was closed under us by stop()
            for source in readable:
                try:
                    data = source.recv(_CHUNK_BYTES)
                except OSError:
                    return
                if not data:
                    return  # one side closed: close both (HTTP/1.1 clients never half-close)
                # The mode may have changed while select waited: bytes read after a switch to
                # BLACKHOLE are held (never forwarded) until the mode changes again.
                if self._wait_out_blackhole() is Mode.RESET or self._stopping.is_set():
                    break  # the loop top aborts both sides (or stop() closes them)
                if self._mode is Mode.LATENCY and self._stopping.wait(self._latency_seconds):
                    return
                if source is client and self._lose is not None and self._lose_this(data):
                    self._forward_and_lose(data, client, upstream)
                    return
                if source is client and self._holding:
                    held = self._hold_or_release(data)
                    if held is not None:  # a held heartbeat: on now, whatever became of its client
                        self._forward_held(held, data, client, upstream)
                        return
                try:
                    peers[source].sendall(data)
                except OSError:
                    return

    def _hold_or_release(self, data: bytes) -> str | None:
        """A heartbeat to hold: its task id (the caller waits for the release). A final update of a
        task whose beat is held: release that beat, wait for it to go out, and return None (the
        update is then sent by the caller)."""
        found = _TASK_ID_RE.search(data)
        if found is None or _UPDATE_RE.match(data) is None:
            return None
        task_id = found.group(1).decode()
        with self._lock:
            if _LEASE_RE.search(data):
                if task_id in self._beating:
                    return None  # one held beat per task; the later ones pass
                self._beating.add(task_id)
                if len(self._beating) % self._hold_every:
                    return None
                self._held[task_id] = threading.Event()
                self._forwarded[task_id] = threading.Event()
                self.held.append(task_id)
                return task_id
            release = self._held.get(task_id)
            forwarded = self._forwarded.get(task_id)
            if release is None or forwarded is None or release.is_set():
                return None
            self.released.append(task_id)
        release.set()
        forwarded.wait(5.0)
        return None

    def _lose_this(self, data: bytes) -> bool:
        with self._lock:
            if self._lose is None or _UPDATE_RE.match(data) is None or not self._lose.search(data):
                return False
            self._lose = None  # the first one only
            found = _TASK_ID_RE.search(data)
            self.lost.append(found.group(1).decode() if found else "")
            return True

    def _forward_and_lose(self, data: bytes, client: socket.socket, upstream: socket.socket) -> None:
        """Send ``data`` on, read the server's answer (it was handled), wait, and reset the client."""
        with contextlib.suppress(OSError):
            upstream.sendall(data)
            upstream.settimeout(5.0)
            upstream.recv(_CHUNK_BYTES)
        self._stopping.wait(self._lose_after)
        _abort(client)

    def _forward_held(self, task_id: str, data: bytes, client: socket.socket,
                      upstream: socket.socket) -> None:
        """Wait for the release, send the held request upstream, and pass its answer back if the
        client is still there (the server handles it either way)."""
        with self._lock:
            release, forwarded = self._held[task_id], self._forwarded[task_id]
        release.wait()
        try:
            if not self._stopping.is_set():
                upstream.sendall(data)
        except OSError:
            return
        finally:
            forwarded.set()
        upstream.settimeout(5.0)
        with contextlib.suppress(OSError):
            answer = upstream.recv(_CHUNK_BYTES)  # the server's answer: the request was handled
            client.sendall(answer)

    def _close_pair(self, client: socket.socket, upstream: socket.socket | None) -> None:
        with self._lock:
            self._sockets.discard(client)
            if upstream is not None:
                self._sockets.discard(upstream)
        client.close()
        if upstream is not None:
            upstream.close()
