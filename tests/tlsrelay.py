"""An https:// front for a loopback server, with a private CA made by the ``openssl`` command.

    certs = make_private_ca(tmp_path)          # certs.ca (PEM), certs.cert / certs.key for 127.0.0.1
    with TlsRelay(certs, "127.0.0.1", backend_port) as relay:
        relay.url_for("/api")                  # "https://127.0.0.1:PORT/api"

One thread accepts (TLS handshake included, bounded); one thread per connection pumps both ways.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path


def make_private_ca(directory: Path) -> Certs:
    """A CA of its own and a server certificate for IP 127.0.0.1 signed by it (openssl CLI)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr",
                                                             "server.pem"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-days", "2", "-subj", "/CN=conductor-run test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return Certs(ca, cert, key)


class TlsRelay:
    """TLS on a loopback port (OS-chosen), plain TCP to ``host:port`` behind it."""

    def __init__(self, certs: Certs, host: str, port: int) -> None:
        self._backend = (host, port)
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(str(certs.cert), str(certs.key))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.handshake_failures = 0

    def url_for(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> TlsRelay:
        thread = threading.Thread(target=self._accept, name="tls-relay", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=10)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            raw.settimeout(10)
            try:
                tls = self._context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                self.handshake_failures += 1  # the client did not trust us: it hangs up
                raw.close()
                continue
            thread = threading.Thread(target=self._pump, args=(tls,), name="tls-pump", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, tls: ssl.SSLSocket) -> None:
        with contextlib.ExitStack() as stack:
            stack.callback(tls.close)
            try:
                backend = socket.create_connection(self._backend, timeout=10)
            except OSError:
                return
            stack.callback(backend.close)
            tls.setblocking(False)
            backend.setblocking(False)
            while not self._stop.is_set():
                ready = [tls] if tls.pending() else select.select([tls, backend], [], [], 0.05)[0]
                for source in ready:
                    target = backend if source is tls else tls
                    try:
                        data = source.recv(65536)
                    except (ssl.SSLWantReadError, BlockingIOError):
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    target.setblocking(True)
                    try:
                        target.sendall(data)
                    except OSError:
                        return
                    finally:
                        target.setblocking(False)
