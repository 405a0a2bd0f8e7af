"""How long a stopping runner may take, from its configuration: what every deploy file must allow."""

from __future__ import annotations

from leasecore.config.loader import ResolvedConfig
from leasecore.runner.ports import RunOptions

MARGIN_SECONDS = 20.0
"""Beyond the budget below: the long poll in flight (at most 5 s + 0.5 s, waited for in parallel with
the trees), signal delivery, and a loaded host."""


def stop_budget_seconds(config: ResolvedConfig) -> float:
    """The longest a SIGTERM'd runner takes to exit, by docs/deployment.md "Shutdown and draining": the
    drain (when on), then the slowest task type's kill_grace, then the final reports (retried for at
    most ``shutdown_report_retry_seconds`` once stopping)."""
    drain = config.runner.drain_timeout if config.runner.drain else 0.0
    grace = max((task.kill_grace for task in config.tasks), default=0.0)
    return drain + grace + RunOptions.shutdown_report_retry_seconds
