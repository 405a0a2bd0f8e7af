#!/bin/sh
# Fails on purpose: says why on stderr and exits with the input's "code" (default 3).
# With terminal_exit_codes = [2] an exit code 2 means FAILED_WITH_TERMINAL_ERROR (no retry).
code="${CONDUCTOR_INPUT_CODE:-3}"
echo "working..."
echo "could not reach the widget service" >&2
exit "$code"
