"""Exit codes of conductor-run, in one place. docs/cli.md's table mirrors this module."""

from __future__ import annotations

OK = 0  # clean stop; with --once: the task COMPLETED
UNEXPECTED = 1  # a bug: an error outside conductor-run's exception tree (traceback printed)
USAGE = 2  # bad flags or arguments (typer/click's own code)
CONFIG = 3  # invalid configuration file, environment value or flag value
UNREACHABLE = 4  # the Conductor server could not be reached, or refused us (credentials, 401/403), at start
TASK_FAILED = 5  # --once / --max-tasks: a task ended FAILED / FAILED_WITH_TERMINAL_ERROR / was fenced
NO_TASK = 6  # --once: no task arrived within the wait
NOT_FOUND = 7  # status TASK_ID: no runner on this host has that task
# pause / resume / reload / drain: no runner answered (none in the state dir, or no --runner PID there)
NO_RUNNER = 8
# pause / resume / reload / drain: a runner refused or did not answer; drain: one did not exit in time
REFUSED = 9
SIGHUP = 129  # stopped by SIGHUP after cleanup (128 + 1): `server` only (a runner reloads on SIGHUP)
SIGINT = 130  # stopped by SIGINT after cleanup (128 + 2)
FORCED = 130  # worker stdio: a second signal ended the running tasks (conductor-cli's code for it)
SIGTERM = 143  # stopped by SIGTERM after cleanup (128 + 15)
