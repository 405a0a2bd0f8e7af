"""A name listed in ``secrets`` never reaches the child, even when the ``env`` table sets it.

From a config file through ``worker.plan_for`` to a real child's environment: the ``env`` table is
merged with the runner's environment and the secret names are stripped from both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from leasecore.config.loader import load_config
from leasecore.process import Supervisor
from leasecore.runner.plans import plan_for

from .process_support import make_task

PRINT_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


def test_a_secret_name_set_in_the_env_table_is_not_passed_to_the_child(tmp_path: Path) -> None:
    config_file = tmp_path / "conductor.toml"
    config_file.write_text(
        "[worker]\n"
        'secrets = ["API_*"]\n'
        "[[task]]\n"
        'type = "t"\n'
        f"command = {json.dumps([sys.executable, '-c', PRINT_ENV])}\n"
        'env = { DB_PASSWORD = "from-the-table", API_TOKEN = "tok", PLAIN = "kept" }\n'
        'secrets = ["DB_PASSWORD"]\n'
    )
    runner_env = {"PATH": "/usr/bin:/bin", "DB_PASSWORD": "from-the-runner", "API_KEY": "k", "HOME": "/h"}
    resolved = load_config({}, runner_env, str(tmp_path), hostname="h")
    (task,) = resolved.tasks
    assert set(task.secrets) == {"API_*", "DB_PASSWORD"}  # [worker] and [[task]] combined
    plan = plan_for(task)

    with Supervisor(None, environ=runner_env) as supervisor:
        child = supervisor.spawn(make_task(), plan.spec, worker_id="w")
        exit_ = child.wait(30)
    assert exit_ is not None and exit_.exit_code == 0, exit_
    env = json.loads(exit_.stdout_tail)
    assert env["PLAIN"] == "kept" and env["HOME"] == "/h"
    for secret in ("DB_PASSWORD", "API_TOKEN", "API_KEY"):
        assert secret not in env, secret
    assert "from-the-table" not in exit_.stdout_tail and "from-the-runner" not in exit_.stdout_tail
