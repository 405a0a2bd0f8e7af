"""Runtime metadata on the host: the private secrets file of a task, a real child reading it and its
variables, the masked output capture, and the embedded server resolving runtimeMetadata at a poll."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from leasecore.masking import Masker
from leasecore.models import Task
from leasecore.process import Supervisor
from leasecore.process.secretenv import SECRETS_FILE_NAME
from leasecore.process.supervisor.output import StreamCapture
from leasecore.process.taskfiles import TaskFiles
from leasecore.server import EmbeddedServer

from .process_support import make_task, spec

READ_SECRETS = (
    "import json, os, sys; p = os.environ['CONDUCTOR_SECRETS_FILE']; st = os.stat(p);"
    "print(json.dumps({'file': json.load(open(p)), 'mode': st.st_mode & 0o777, 'path': p,"
    " 'env': os.environ.get('API_TOKEN')}));"
    "print('leak ' + os.environ['API_TOKEN'])"
)


def test_the_secrets_file_is_private_holds_the_object_and_goes_with_the_task(tmp_path: Path) -> None:
    task = make_task(runtime_metadata={"API_TOKEN": "tok-123", "odd-name": "v"})
    files = TaskFiles.create(task, parent=str(tmp_path), secrets=task.runtime_metadata)
    assert files.secrets_path == os.path.join(files.directory, SECRETS_FILE_NAME)
    info = os.stat(files.secrets_path)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert json.loads(Path(files.secrets_path).read_text()) == {"API_TOKEN": "tok-123", "odd-name": "v"}
    files.remove()
    assert not os.path.exists(files.directory)
    without = TaskFiles.create(make_task(), parent=str(tmp_path))
    assert without.secrets_path is None
    assert sorted(os.listdir(without.directory)) == ["checkpoint.json", "input.json", "output.json"]
    without.remove()


def test_a_real_child_reads_its_secrets_and_its_output_is_masked() -> None:
    task = make_task(runtime_metadata={"API_TOKEN": "tok-123456"}, declared_metadata=("API_TOKEN",))
    masker = Masker.of(task.runtime_metadata.values())
    lines: list[str] = []
    with Supervisor(None, environ={"PATH": os.environ["PATH"]}) as supervisor:
        child = supervisor.spawn(task, spec(sys.executable, "-c", READ_SECRETS, masker=masker), worker_id="w",
                                 on_line=lambda _stream, line: lines.append(line))  # fmt: skip
        exit_ = child.wait(30)
    assert exit_ is not None and exit_.exit_code == 0, exit_
    seen = json.loads(exit_.stdout_tail.splitlines()[0].replace("***", "tok-123456"))
    assert seen["mode"] == 0o600 and seen["env"] == "tok-123456"
    assert seen["file"] == {"API_TOKEN": "tok-123456"}
    assert not os.path.exists(seen["path"])  # removed with the task's files
    assert "tok-123456" not in exit_.stdout_tail and "leak ***" in exit_.stdout_tail
    assert "leak ***" in lines and not any("tok-123456" in line for line in lines)


def test_the_capture_masks_a_value_cut_by_the_line_limit_and_split_reads() -> None:
    masker = Masker.of(["SECRETVALUE"])
    lines: list[str] = []
    capture = StreamCapture(lines.append, max_line_bytes=16, mask=masker.stream())
    for chunk in (b"0123456789abSECR", b"ETVALUE tail\nlast SEC", b"RETVALUE"):
        capture.feed(chunk)
    capture.close()
    joined = "".join(lines)
    assert "SECRETVALUE" not in joined and "SECR" not in joined and joined.count("***") == 2
    assert capture.total_bytes == 16 + 21 + 8  # what the child wrote, not what was passed on
    assert "last ***" in capture.tail()


def test_the_embedded_server_resolves_runtime_metadata_at_the_poll_and_never_stores_it() -> None:
    environ = {"CONDUCTOR_SECRET_API_TOKEN": "from-secret", "CONDUCTOR_ENV_API_TOKEN": "from-env",
               "CONDUCTOR_ENV_REGION": "eu-1"}  # fmt: skip
    with EmbeddedServer(runtime_environ=environ) as server:
        store = server.store
        store.register_task_defs([{"name": "t", "runtimeMetadata": ["API_TOKEN", "REGION", "MISSING"]}])
        store.register_workflow_def({"name": "wf", "version": 1, "schemaVersion": 2, "tasks": [
            {"name": "t", "taskReferenceName": "t", "type": "SIMPLE"}]})  # fmt: skip
        store.start_workflow("wf", {})
        (polled,) = store.poll("t", count=1, timeout_ms=0, worker_id="w")
        assert polled["runtimeMetadata"] == {"API_TOKEN": "from-secret", "REGION": "eu-1"}  # secret first
        task = Task.from_json(polled)
        assert task.declared_metadata == ("API_TOKEN", "REGION", "MISSING")
        stored = store.get_task(task.task_id)
        assert "runtimeMetadata" not in stored and "from-secret" not in json.dumps(stored)
