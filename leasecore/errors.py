"""The one exception tree of conductor-run.

Everything conductor-run raises on purpose derives from :class:`ConductorRunError`. Adapters
translate library errors (``requests``, ``OSError``) into this tree once, at their boundary, with
``raise ... from exc``; the CLI maps the tree to messages and exit codes in one place.

    ConductorRunError
    ├── ConfigError                 bad configuration: key, source, what is allowed
    ├── ConductorError              talking to the Conductor server
    │   ├── ConductorUnavailable    network error, timeout, 5xx: retryable
    │   ├── ConductorRejected       4xx, or a 5xx marked retryable:false: the server said no
    │   │   ├── ConductorNotFound   404: the task or workflow is gone
    │   │   └── ConductorAuthError  401/403 after a token refresh, or bad credentials
    │   └── ConductorProtocolError  a 2xx answer we cannot understand
    ├── LeaseLost                   the lease can no longer be trusted
    └── ProcessError                spawning or controlling a child failed
        └── SpawnError              the command could not be started

Owns the tree only; the messages are the raisers', the exit codes ``cli/``'s. Threads: any.
"""

from __future__ import annotations


class ConductorRunError(Exception):
    """Root of every error conductor-run raises on purpose."""


class ConfigError(ConductorRunError):
    """Invalid configuration: names the key, where the value came from and what is allowed."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.source = source


class ConductorError(ConductorRunError):
    """A call to the Conductor server failed."""

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        method: str | None = None,
        path: str | None = None,
        status_code: int | None = None,
        body_excerpt: str | None = None,
    ) -> None:
        super().__init__(message)
        self.method = method
        self.path = path
        self.status_code = status_code
        self.body_excerpt = body_excerpt


class ConductorUnavailable(ConductorError):
    """The server could not be reached or answered 5xx; trying again may work."""

    retryable = True


class ConductorRejected(ConductorError):
    """The server said no (4xx, or a 5xx marked ``retryable: false``): retrying won't help."""


class ConductorNotFound(ConductorRejected):
    """404: the task or workflow no longer exists on the server."""


class ConductorAuthError(ConductorRejected):
    """Authentication failed (bad key/secret, or 401/403 even after a token refresh).

    ``without_credentials``: we sent none (none are configured), so the server wants some; the
    message then already says which variables to set.
    """

    without_credentials = False


class ConductorProtocolError(ConductorError):
    """A 2xx answer that does not have the shape the protocol promises."""


class LeaseLost(ConductorRunError):
    """The task's lease can no longer be trusted; its child must not keep running."""


class ProcessError(ConductorRunError):
    """Starting or controlling a child process failed."""


class SpawnError(ProcessError):
    """The command could not be started (not found, not executable, bad cwd)."""
