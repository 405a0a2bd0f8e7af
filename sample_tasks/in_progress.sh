#!/bin/sh
# Yields back to Conductor until the task has been polled "polls" times (default 3): exit code 10 is
# configured as in_progress_exit_code, so the task goes IN_PROGRESS with callbackAfterSeconds and
# is delivered again later (CONDUCTOR_POLL_COUNT grows on each delivery).
polls="${CONDUCTOR_INPUT_POLLS:-3}"
if [ "${CONDUCTOR_POLL_COUNT:-0}" -lt "$polls" ]; then
    echo "not ready yet (poll ${CONDUCTOR_POLL_COUNT:-0} of $polls)"
    exit 10
fi
printf '{"ready": true}\n' > "$CONDUCTOR_OUTPUT_FILE"
