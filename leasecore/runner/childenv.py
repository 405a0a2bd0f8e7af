"""What the runner hands every child about the server: its URL always, its credentials on request.

Owns ``handed_env(server)``, the variables set in the child's environment after the credential filter
(``leasecore.process.spec.CREDENTIAL_PATTERNS`` strips every ``CONDUCTOR_AUTH_*`` and
``CONDUCTOR_ACCESS_KEY_*`` the runner inherited or the config's ``env`` table set):

- ``CONDUCTOR_SERVER_URL``: the URL the runner itself uses, whatever gave it (flag, file, profile,
  environment), so a script can call back into the same server. Without ``pass_credentials`` a
  ``user:password@``, a query and a fragment are cut from it (``snapshot.redact_url``): a password
  in the URL is a credential too.
- with ``pass_credentials`` only: the credentials in both spellings a script may read, this
  project's and the SDKs' (``CONDUCTOR_AUTH_KEY`` / ``CONDUCTOR_AUTH_SECRET``, or
  ``CONDUCTOR_AUTH_TOKEN``) and conductor-cli's (``CONDUCTOR_ACCESS_KEY_ID`` /
  ``CONDUCTOR_ACCESS_KEY_SECRET``), and the URL as given.

``credential_values(server)`` is the hook for output masking: the values handed to children, which
must never come back in a task log, an output or a reason.

Pure: values in, values out. Threads: any.
"""

from __future__ import annotations

from leasecore.config.settings import ServerSettings
from leasecore.snapshot import redact_url

SERVER_URL_VAR = "CONDUCTOR_SERVER_URL"


def handed_env(server: ServerSettings) -> dict[str, str]:
    """The variables every child of a runner on ``server`` gets (see the module docstring)."""
    if not server.pass_credentials:
        return {SERVER_URL_VAR: redact_url(server.url)}
    env = {SERVER_URL_VAR: server.url}
    if server.auth_key and server.auth_secret:
        env.update(
            CONDUCTOR_AUTH_KEY=server.auth_key,
            CONDUCTOR_AUTH_SECRET=server.auth_secret,
            CONDUCTOR_ACCESS_KEY_ID=server.auth_key,
            CONDUCTOR_ACCESS_KEY_SECRET=server.auth_secret,
        )
    elif server.auth_token:
        env["CONDUCTOR_AUTH_TOKEN"] = server.auth_token
    return env


def credential_values(server: ServerSettings) -> tuple[str, ...]:
    """The secret values ``handed_env`` gives children (empty without ``pass_credentials``): what an
    output masker must hide."""
    if not server.pass_credentials:
        return ()
    found = [server.auth_key, server.auth_secret, server.auth_token]
    url = server.url
    if url != redact_url(url):
        found.append(url)
    return tuple(value for value in found if value)


def warning_for(server: ServerSettings) -> str | None:
    """The start-up warning ``pass_credentials`` earns (None when off)."""
    if not server.pass_credentials:
        return None
    if not (server.auth_key or server.auth_token):
        return ("pass_credentials is on but no credentials are configured: children get "
                "CONDUCTOR_SERVER_URL only")  # fmt: skip
    return ("pass_credentials is on: every child gets this runner's Conductor credentials in its "
            "environment (CONDUCTOR_AUTH_*, CONDUCTOR_ACCESS_KEY_*); anything it runs can read and "
            "use them")  # fmt: skip
