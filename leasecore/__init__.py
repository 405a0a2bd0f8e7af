"""leasecore: the engine behind conductor-run.

Core modules (pure, stdlib only, clock injected): ``errors``, ``models``, ``clock``, ``lease``,
``backoff``, ``config``. Adapters (I/O): the Conductor HTTP client, process supervision, state files,
the runner loop and the embedded server. Imports flow one way: ``cli`` -> adapters -> core.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
