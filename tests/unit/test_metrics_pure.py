"""The metrics' pure parts: label values, the probes' decisions, the config keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from leasecore.config.loader import parse_toml, resolve
from leasecore.errors import ConfigError, SpawnError
from leasecore.lease import FenceReason
from leasecore.metrics import NO_METRICS, execute_error, final_status
from leasecore.metrics.health import HealthFacts, RunPhase, liveness, readiness
from leasecore.models import TaskStatus

BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


@dataclass
class Exit:
    exit_code: int | None = 0
    signal: int | None = None
    duration_seconds: float = 1.0
    start_error: str | None = None


@pytest.mark.parametrize(
    ("exit_", "fence", "expected"),
    [
        (Exit(0), None, None),
        (Exit(3), None, "NonZeroExit"),
        (Exit(75), None, None),  # the in-progress exit code: a deliberate hand-back, not an error
        (Exit(None, signal=9), None, "KilledBySignal"),
        (Exit(None, signal=15), FenceReason.EXEC_TIMEOUT, "Fenced"),
        (Exit(0), FenceReason.SHUTDOWN, "Fenced"),  # stopped by us: its result is FAILED
        (Exit(None, start_error="exec failed"), None, "StartError"),
        (SpawnError("no such command"), None, "SpawnError"),
        (None, None, "LostChild"),
    ],
)
def test_execute_error_labels_a_non_zero_exit_and_what_else_failed(exit_: Any, fence: Any,
                                                                   expected: str | None) -> None:
    assert execute_error(exit_, fence, 75) == expected


def test_final_status_is_the_accepted_status_or_why_there_is_none() -> None:
    assert final_status(TaskStatus.COMPLETED, None) == "COMPLETED"
    assert final_status(TaskStatus.FAILED, FenceReason.EXEC_TIMEOUT) == "FAILED"
    assert final_status(None, FenceReason.OWNERSHIP_LOST) == "OWNERSHIP_LOST"
    assert final_status(None, None) == "UNDELIVERED"


def test_the_default_observer_is_off_and_does_nothing() -> None:
    assert NO_METRICS.enabled is False
    NO_METRICS.on_poll("t", 0.1, None)
    NO_METRICS.on_task_exited("t", None, None, None)
    NO_METRICS.on_task_done("t", None, None)


def _serving(**changes: Any) -> HealthFacts:
    facts: dict[str, Any] = {"phase": RunPhase.SERVING, "loop_age_seconds": 0.2, "forkserver_up": True,
                             "contact_age_seconds": 1.0, "poll_window_seconds": 15.0, "talking": True}
    return HealthFacts(**(facts | changes))


def test_a_serving_runner_that_heard_from_the_server_is_alive_and_ready() -> None:
    assert liveness(_serving()) == (True, "serving")
    assert readiness(_serving()) == (True, "ready")


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (_serving(phase=RunPhase.STOPPING), "stopping: no new work is taken"),
        (_serving(phase=RunPhase.STARTING), "starting: not polling yet"),
        (_serving(forkserver_up=False), "the fork server is down (a new one starts with the next task)"),
        (_serving(contact_age_seconds=None), "no answer from the Conductor server yet"),
        (_serving(contact_age_seconds=40.0),
         "no answer from the Conductor server for 40 s (poll window 15 s)"),
    ],
)
def test_not_ready_says_why_in_one_line(facts: HealthFacts, reason: str) -> None:
    ready, why = readiness(facts)
    assert not ready and why == reason and "\n" not in why


def test_stopping_and_a_quiet_server_keep_the_runner_alive() -> None:
    """Liveness restarts the process: only for what a restart cures, never for a draining runner or
    a server that is away (a restart would not bring it back, and would kill the running tasks)."""
    assert liveness(_serving(phase=RunPhase.STOPPING)) == (True, "stopping")
    assert liveness(_serving(contact_age_seconds=600.0))[0]
    assert liveness(_serving(forkserver_up=False))[0]
    assert liveness(HealthFacts(phase=RunPhase.STARTING)) == (True, "starting")


def test_a_stalled_loop_a_dead_thread_or_the_end_are_not_alive() -> None:
    assert liveness(_serving(loop_age_seconds=31.0)) == (
        False, "the runner's main loop has not turned for 31 s")
    assert liveness(_serving(dead_threads=("the poller of encode",))) == (
        False, "dead: the poller of encode")
    assert liveness(HealthFacts(phase=RunPhase.STOPPED)) == (False, "the runner has stopped")
    assert readiness(_serving(loop_age_seconds=31.0))[0] is False


def test_a_runner_with_nothing_to_say_to_the_server_does_not_wait_for_an_answer() -> None:
    # Every type paused and no task in flight: no call is made, so none can be answered.
    assert readiness(_serving(talking=False, contact_age_seconds=None)) == (True, "ready")


def _runner(environ: dict[str, str] | None = None, overrides: dict[str, Any] | None = None,
            text: str = BASE) -> Any:
    return resolve(parse_toml(text, "conductor.toml"), environ or {}, overrides or {}, cwd="/work",
                   hostname="h").runner


def test_metrics_are_off_by_default_and_set_by_flag_env_or_file() -> None:
    assert _runner().metrics_port is None and _runner().metrics_host == "127.0.0.1"
    assert _runner(overrides={"metrics_port": 9464}).metrics_port == 9464
    env = _runner({"CONDUCTOR_RUN_METRICS_PORT": "9100", "CONDUCTOR_RUN_METRICS_HOST": "0.0.0.0"})
    assert (env.metrics_port, env.metrics_host) == (9100, "0.0.0.0")
    assert str(env.sources["metrics_port"]) == "env CONDUCTOR_RUN_METRICS_PORT"
    file = _runner(text='[worker]\nmetrics_port = 0\nmetrics_host = "::1"\n' + BASE)
    assert (file.metrics_port, file.metrics_host) == (0, "::1")


@pytest.mark.parametrize(
    ("overrides", "environ", "expected"),
    [
        ({"metrics_port": 70000}, {}, "invalid metrics_port = 70000 (from flag --metrics-port): expected a "
                                      "TCP port from 0 to 65535"),
        ({"metrics_port": -1}, {}, "invalid metrics_port = -1 (from flag --metrics-port)"),
        ({}, {"CONDUCTOR_RUN_METRICS_PORT": "http"}, "invalid metrics_port = 'http' (from env "
                                                     "CONDUCTOR_RUN_METRICS_PORT): expected an integer"),
        ({"metrics_host": "localhost"}, {}, "invalid metrics_host = 'localhost' (from flag --metrics-host): "
                                            "expected an IP address to listen on"),
        ({"metrics_host": "300.1.1.1"}, {}, "invalid metrics_host = '300.1.1.1'"),
    ],
)
def test_a_bad_port_or_address_is_one_line_naming_key_source_and_what_is_allowed(
    overrides: dict[str, Any], environ: dict[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _runner(environ, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)
