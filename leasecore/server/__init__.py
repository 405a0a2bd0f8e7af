"""The embedded Conductor-compatible server (in memory, stdlib only): ``EmbeddedServer``.

``store`` is the facade over the state and the decider (clock injected; its parts are composed,
see its docstring), ``api`` the routes, auth and errors, ``httpd`` the socket layer, ``embedded``
the lifecycle. See CONDUCTOR_PROTOCOL.md §12 for the semantics it reproduces.
"""

from leasecore.server.embedded import EmbeddedServer
from leasecore.server.store import SweepMode

__all__ = ["EmbeddedServer", "SweepMode"]
