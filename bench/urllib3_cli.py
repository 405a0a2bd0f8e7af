"""``python -m bench.urllib3_cli run ...``: conductor-run with its plain-HTTP transport replaced by the
urllib3-direct prototype of :mod:`bench.transport_ab` (the ``conductor-run-urllib3`` worker kind of
the throughput A/B; never a product path). Everything else, https and proxies included, unchanged.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import leasecore.conductor.client as conductor
from bench.transport_ab import Urllib3Transport
from leasecore.conductor.transport import Transport

_chosen = conductor.open_transport


def _open(base_url: str, **options: Any) -> Transport:
    if urlsplit(base_url).scheme == "http" and options.get("session") is None:
        return Urllib3Transport(
            base_url,
            pool_maxsize=options["pool_maxsize"],
            max_body_bytes=options["max_body_bytes"],
            monotonic=options["monotonic"],
        )
    return _chosen(base_url, **options)


conductor.open_transport = _open  # the one choice of transport, looked up by name at each client

if __name__ == "__main__":
    from cli.main import main

    main()
