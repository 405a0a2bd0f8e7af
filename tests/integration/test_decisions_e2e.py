"""The exit-code policy and the child's ``$`` keys, end to end: a real runner, the embedded server on
loopback, and a child that writes its input's ``x`` to its output file and exits with ``code`` (on its
first delivery; a delivery after a yield completes). One runner serves every case at once."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from cli import exitcodes
from leasecore.process.checkpoint import LOG_MARKER
from tests.integration.helpers import World
from tests.support import wait_until

CHILD = ["/bin/sh", "-c",
         'out="$CONDUCTOR_OUTPUT_FILE"; if [ "$CONDUCTOR_POLL_COUNT" -gt 1 ]; then '
         'echo \'{"again": true}\' > "$out"; exit 0; fi; printf \'%s\' "$CONDUCTOR_INPUT_X" > "$out"; '
         'echo "stderr of $CONDUCTOR_INPUT_CODE" >&2; exit "$CONDUCTOR_INPUT_CODE"']
POLICY = ("--exit-code", "4=COMPLETED", "--exit-code", "5=IN_PROGRESS:0",
          "--exit-code=6=FAILED_WITH_TERMINAL_ERROR", "--terminal-exit-code", "8")
TERMINAL = "FAILED_WITH_TERMINAL_ERROR"

# case: (exit code, output file, task status, reason, pollCount, output keys it must hold)
CASES = {
    "policy COMPLETED": (4, "", "COMPLETED", None, 1, {"exitCode": 4}),
    "policy IN_PROGRESS": (5, "", "COMPLETED", None, 2, {"again": True}),
    "policy FAILED_WITH_TERMINAL_ERROR": (6, "", TERMINAL, "exit code 6: stderr of 6", 1, {}),
    "shorthand terminal": (8, "", TERMINAL, "exit code 8: stderr of 8", 1, {}),
    "no policy": (9, "", "FAILED", "exit code 9: stderr of 9", 1, {}),
    "$status terminal": (0, '{"$status": "FAILED_WITH_TERMINAL_ERROR", "$reason": "bad input", "k": 1}',
                         "FAILED_WITH_TERMINAL_ERROR", "bad input", 1, {"k": 1}),
    "$status IN_PROGRESS": (0, '{"$status": "IN_PROGRESS", "$callbackAfterSeconds": 0}', "COMPLETED", None, 2,
                            {"again": True}),
    "$status COMPLETED over exit 1": (1, '{"$status": "COMPLETED", "v": 2}', "COMPLETED", None, 1, {"v": 2}),
    "policy over $status": (6, '{"$status": "COMPLETED", "$reason": "why"}', "FAILED_WITH_TERMINAL_ERROR",
                            "why", 1, {}),
    "invalid $status": (0, '{"$status": "DONE"}', "FAILED", "CONDUCTOR_OUTPUT_FILE: $status must be one of "
                        "COMPLETED, FAILED, FAILED_WITH_TERMINAL_ERROR, IN_PROGRESS, not 'DONE'", 1, {}),
    "invalid $callbackAfterSeconds": (
        0, '{"$status": "IN_PROGRESS", "$callbackAfterSeconds": "soon"}', "FAILED",
        "CONDUCTOR_OUTPUT_FILE: $callbackAfterSeconds must be whole seconds from 0 to 31536000, not 'soon'",
        1, {},
    ),
}


def test_each_policy_and_each_dollar_key_decides_as_documented(world: World) -> None:
    world.define(response_timeout=5)
    flows = {case: world.start_workflow(code=code, x=x) for case, (code, x, *_) in CASES.items()}
    runner = world.run(*POLICY, command=CHILD)
    wait_until(lambda: all(world.workflow_status(wf) != "RUNNING" for wf in flows.values()),
               timeout_seconds=90, what="every workflow to end")
    runner.send_signal(signal.SIGTERM)
    code, err = world.finish(runner)
    for case, (_, _, status, reason, polls, holds) in CASES.items():
        task = world.task_of(flows[case])
        seen = (task["status"], task.get("reasonForIncompletion"), task["pollCount"])
        assert seen == (status, reason, polls), (case, seen, err)
        output = task["outputData"]
        assert holds.items() <= output.items(), (case, output)
        assert not [key for key in output if key.startswith("$")], (case, output)
    assert code == exitcodes.SIGTERM, err
    assert "Traceback" not in err


def test_a_bad_policy_on_the_command_line_is_a_config_error(world: World) -> None:
    code, err = world.finish(world.run("--exit-code", "3=DONE", command=CHILD))
    assert code == exitcodes.CONFIG, err
    assert "exit_codes" in err and "--exit-code" in err and "IN_PROGRESS:SECONDS" in err
    assert "Traceback" not in err
    both = world.run("--exit-code", "3=COMPLETED", "--terminal-exit-code", "3", command=CHILD)
    code, err = world.finish(both)
    assert code == exitcodes.CONFIG and "terminal_exit_codes" in err and "exit code 3" in err, err


def test_an_unusable_checkpoint_is_said_in_the_log_and_fails_nothing(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=5)
    big = "x" * 20000
    script = ('echo \'{"step": 1}\' > "$CONDUCTOR_CHECKPOINT_FILE"; sleep 2.5; '
              'printf \'{"step": 2\' > "$CONDUCTOR_CHECKPOINT_FILE"; sleep 2.5; '
              f'echo \'"{big}"\' > "$CONDUCTOR_CHECKPOINT_FILE"; sleep 2.5; '
              'ln -sf /etc/passwd "$CONDUCTOR_CHECKPOINT_FILE"')
    wf = world.start_workflow()
    code, err = world.finish(world.run("--max-tasks", "1", command=["/bin/sh", "-c", script]), timeout=90)
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED", err
    assert task["outputData"]["checkpoint"] == {"step": 1}  # the last valid one stands
    lines = [line for entry in world.admin.get_logs(task["taskId"]) for line in entry["log"].splitlines()]
    marked = [json.loads(line[len(LOG_MARKER):]) for line in lines if line.startswith(LOG_MARKER)]
    assert marked == [{"step": 1}], lines
    said = "\n".join(line for line in lines if line.startswith("conductor-run: CONDUCTOR_CHECKPOINT_FILE"))
    assert "is not valid JSON" in said and "too large (over 16000 bytes)" in said, lines
    assert "symbolic link (not followed)" in said, lines
    assert code == exitcodes.OK, err
