#!/bin/sh
# A long job: sleeps for the input's "seconds" (default 30), then reports how long it slept.
# Input arrives as data: $CONDUCTOR_INPUT_SECONDS is an environment value, never code.
set -eu
seconds="${CONDUCTOR_INPUT_SECONDS:-30}"
echo "sleeping ${seconds}s (task ${CONDUCTOR_TASK_ID:-?})"
sleep "$seconds"
printf '{"slept": %s}\n' "$(printf '%s' "$seconds" | tr -cd '0-9.')" > "$CONDUCTOR_OUTPUT_FILE"
echo "done"
