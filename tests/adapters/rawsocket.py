"""A TCP server by hand on 127.0.0.1:0 for the lean transport's tests: one thread per connection runs
the subclass's ``serve(conn, number)``, so a test decides every byte, and every misbehaviour, itself."""

from __future__ import annotations

import socket
import threading


class ThreadedSocketServer:
    """Accepts on 127.0.0.1:0; ``connections`` counts them. Set a subclass's own fields before
    calling ``__init__``: the first connection may be served at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.threads: list[threading.Thread] = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def serve(self, conn: socket.socket, number: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not)
        self.listener.close()
        self.accepter.join(10)
        for thread in self.threads:
            thread.join(10)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                number = self.connections
            thread = threading.Thread(target=self.serve, args=(conn, number), daemon=True)
            self.threads.append(thread)
            thread.start()
