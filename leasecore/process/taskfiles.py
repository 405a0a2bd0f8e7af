"""A task's private files: the input file (also the child's stdin) and the output file.

Owns ``TaskFiles``: each task's own directory (0700, named by the tree's marker token, in the place
``TaskDirs`` picks: a tmpfs such as ``/dev/shm`` where one is usable, else the system temp dir)
holding ``input.json`` (0600, ``inputData`` as JSON), an empty ``output.json``
(0600) for the child to fill, ``checkpoint.json`` (0600: the task's last checkpoint, or empty;
``leasecore.process.checkpoint``), under the stdio protocol ``task.json`` (0600, the whole task: the
child's stdin then), and for a task with runtime metadata ``secrets.json`` (0600, ``secretenv``).
With ``run_as`` the input, output, checkpoint and secrets files are the user's; the directory stays root's.
Reading the output file (``read_output_file``) is bounded by ``OUTPUT_FILE_LIMIT_BYTES`` and
``OUTPUT_MAX_DEPTH``, and never follows a symlink or blocks on a FIFO the child may have put there;
the directory is removed once the child is done (``remove``; a filled one through the chores thread).

Must not touch: anything outside the task's directory (no symlink is followed out of it), or the
child's processes.

Threads: created on the thread that starts a spawn; read and removed on the Supervisor's reader
thread (``Child._finish``), a filled directory removed on the chores thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from leasecore.errors import SpawnError
from leasecore.models import Task
from leasecore.process.linux.leftovers import TASK_FILE_NAMES, TMP_PREFIX, remove_tmpdir
from leasecore.process.linux.procfs import fstype_of
from leasecore.process.payload import OUTPUT_DATA_LIMIT_BYTES, deeper_than, json_size, too_large
from leasecore.process.secretenv import SECRETS_FILE_NAME

STDIN_FILE_NAME = "task.json"  # stdio protocol: the child's stdin (the input file stays inputData)

# The output object may be as big as the whole outputData the server keeps without external storage
# (3 MiB, payload.py); what the runner adds to it is checked with it, when the result is made.
OUTPUT_FILE_LIMIT_BYTES = OUTPUT_DATA_LIMIT_BYTES
OUTPUT_MAX_DEPTH = 256  # Conductor's JSON parser refuses 1000 levels; the report adds some, and frames
_JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


SHM_DIR = "/dev/shm"
_TEMP_ENV = ("TMPDIR", "TEMP", "TMP")  # what tempfile.gettempdir() reads: a user's explicit choice
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class TaskDirs:
    """Where task directories are made: ``fast`` (a tmpfs) for a tree without a memory limit, else
    ``disk`` (the system temp dir); a full ``fast`` falls back to ``disk`` for that task.

    On an ext4 /tmp a task's files (mkdir, two creates, two unlinks, rmdir) cost 0.2-0.35 ms of the
    runner's CPU per task, most of it in the journal; on a tmpfs next to nothing (docs/benchmarks.md).
    A memory-limited tree stays on ``disk``: what it writes into its directory on a tmpfs would be
    charged to its group as memory that cannot be written back, so a big output file could OOM-kill
    it where the disk would not."""

    disk: str
    fast: str | None = None

    @classmethod
    def pick(cls, chosen: str | None = None, environ: Mapping[str, str] | None = None,
             shm: str = SHM_DIR) -> TaskDirs:
        """``chosen`` (a directory given by the embedder) is used for every task; so is the temp dir
        a user named in ``TMPDIR``/``TEMP``/``TMP``. Otherwise ``shm`` when it is a tmpfs this
        process can write, and the temp dir is not one already."""
        if chosen is not None:
            return cls(os.path.abspath(chosen))
        environ = os.environ if environ is None else environ
        disk = tempfile.gettempdir()
        chosen_by_user = any(environ.get(name) for name in _TEMP_ENV)
        usable = os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) and _is_tmpfs(shm)
        if chosen_by_user or not usable or _is_tmpfs(disk):
            return cls(disk)
        return cls(disk, shm)

    def parent(self, memory_limited: bool) -> str:
        return self.disk if memory_limited or self.fast is None else self.fast


def _is_tmpfs(path: str) -> bool:
    return fstype_of(path) == "tmpfs"


@dataclass(frozen=True, eq=False)
class TaskFiles:
    """Paths of one task's private files."""

    directory: str
    input_path: str
    output_path: str
    stdin_path: str | None = None  # a file of its own for stdin (else the input file is stdin)
    checkpoint_path: str = ""  # CONDUCTOR_CHECKPOINT_FILE
    secrets_path: str | None = None  # the task's runtime metadata (secretenv), when it has any

    @classmethod
    def create_in(
        cls, dirs: TaskDirs, task: Task, *, memory_limited: bool, unique: str | None = None,
        stdin: bytes | None = None, owner: tuple[int, int] | None = None, checkpoint: bytes = b"",
        secrets: Mapping[str, str] | None = None,
    ) -> TaskFiles:
        """``create`` in ``dirs.parent(memory_limited)``; if that is the tmpfs and it is full, in
        ``dirs.disk`` instead (a small /dev/shm, as a container's 64 MB one, fails no task)."""
        parent = dirs.parent(memory_limited)
        try:
            return cls.create(task, parent=parent, unique=unique, stdin=stdin, owner=owner,
                              checkpoint=checkpoint, secrets=secrets)
        except OSError as exc:
            if parent == dirs.disk or exc.errno not in _FULL:
                raise
        return cls.create(task, parent=dirs.disk, unique=unique, stdin=stdin, owner=owner,
                          checkpoint=checkpoint, secrets=secrets)

    @classmethod
    def create(
        cls, task: Task, *, parent: str | None = None, unique: str | None = None, stdin: bytes | None = None,
        owner: tuple[int, int] | None = None, checkpoint: bytes = b"",
        secrets: Mapping[str, str] | None = None,
    ) -> TaskFiles:
        """Make the directory and the files; the input file holds ``task.input_data`` as JSON, the
        checkpoint file ``checkpoint`` (the task's last checkpoint, or nothing).
        ``stdin``: what the child reads on stdin instead (a file of its own, ``STDIN_FILE_NAME``).

        ``unique``: random hex (the tree's marker token) to name the directory by, instead of
        ``mkdtemp``'s own draw (a pid check and eight random choices per task); a name taken
        already falls back to ``mkdtemp``. ``owner`` (uid, gid): the user the child runs as
        owns both files (it reads the input, writes the output); the directory stays the runner's
        (mode 0710, group ``gid``: the child can reach the files but not rename, replace or add
        any): the runner, as root, later reads ``output.json`` and deletes the directory, which a
        directory of the child's own could have turned into a symbolic link elsewhere.
        ``secrets``: the task's runtime metadata, written as a JSON object to ``SECRETS_FILE_NAME``
        (0600, the child's user's like the others; None: no such file)."""
        directory = None
        if unique:
            path = _name_prefix(parent or tempfile.gettempdir()) + unique[:16]
            try:
                os.mkdir(path, 0o700)  # fails on anything already there, a symlink included
                directory = path
            except FileExistsError:
                pass
        if directory is None:
            directory = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)
        # (a directory's name never ends in "/": + "/" + name is os.path.join, a call less per file)
        input_name, output_name, checkpoint_name = TASK_FILE_NAMES
        stdin_path = None if stdin is None else directory + "/" + STDIN_FILE_NAME
        secrets_path = None if secrets is None else directory + "/" + SECRETS_FILE_NAME
        files = cls(directory, directory + "/" + input_name, directory + "/" + output_name,
                    stdin_path, directory + "/" + checkpoint_name, secrets_path)  # fmt: skip
        try:
            body = dump_json(task.input_data, "the task's input") if task.input_data else b"{}"
            _write_private(files.input_path, body)
            _write_private(files.output_path, b"")
            _write_private(files.checkpoint_path, checkpoint)  # (empty, the common case: one mknod)
            if stdin_path is not None and stdin is not None:
                _write_private(stdin_path, stdin)  # opened by the runner for the child, never by path
            if secrets_path is not None and secrets is not None:
                _write_private(secrets_path, dump_json(secrets, "the task's runtime metadata"))
            if owner is not None:
                _hand_over(files, *owner)
        except BaseException:
            files.remove()
            raise
        return files

    def open_stdin(self) -> int:
        """A fresh read-only fd on the input file (its own offset), to become the child's stdin."""
        return os.open(self.stdin_path or self.input_path, os.O_RDONLY | os.O_CLOEXEC)

    def read_output(self) -> tuple[dict[str, Any] | None, str | None]:
        """``(object, None)``, ``(None, None)`` when nothing was written, or ``(None, reason)``."""
        return read_output_file(self.output_path)

    def remove(self, rmtree: Callable[[str], None] | None = None) -> None:
        """Remove the directory; ``rmtree``: what removes it when the child put more there."""
        for path in (self.stdin_path, self.secrets_path):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        remove_tmpdir(self.directory, rmtree)


_PREFIXES: dict[str, str] = {}  # an absolute parent -> its task directories' names before the token


def _name_prefix(parent: str) -> str:
    """``os.path.join(os.path.abspath(parent), TMP_PREFIX)``, kept per absolute parent (the few a
    Supervisor uses: abspath's normalising is a dozen Python calls a task otherwise)."""
    prefix = _PREFIXES.get(parent)
    if prefix is None:
        prefix = os.path.join(os.path.abspath(parent), TMP_PREFIX)
        if os.path.isabs(parent) and len(_PREFIXES) < 16:  # a relative one depends on the cwd
            _PREFIXES[parent] = prefix
    return prefix


def dump_json(value: Mapping[str, Any], what: str) -> bytes:
    """``value`` as UTF-8 JSON; with ``\\u`` escapes when it holds lone surrogates (a Java server
    can send them), which strict UTF-8 cannot carry but every JSON parser reads. SpawnError "``what``
    is nested too deeply to pass on" when it cannot be written (``what``: "the task's input")."""
    try:
        try:
            return json.dumps(dict(value), ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return json.dumps(dict(value)).encode()
    except RecursionError:  # parsed on the poller's thread, too deep to write back on this one
        raise SpawnError(f"{what} is nested too deeply to pass on") from None


def _hand_over(files: TaskFiles, uid: int, gid: int) -> None:
    for path in (files.input_path, files.output_path, files.checkpoint_path, files.secrets_path):
        if path is not None:
            os.chown(path, uid, gid)
    os.chown(files.directory, -1, gid)
    os.chmod(files.directory, 0o710)


def _write_private(path: str, body: bytes) -> None:
    if not body:  # one syscall instead of an open and a close; the same mode, umask, and refusal of
        try:  # anything already there (a symlink included): mknod, like O_EXCL, never follows one
            os.mknod(path, 0o600 | stat.S_IFREG)
            return
        except FileExistsError:
            raise
        except OSError:  # a file system that makes no regular file this way: the open below
            pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:  # not os.fdopen: its buffered file costs an fstat, an isatty and an lseek per task
        written = os.write(fd, body)
        if written < len(body):  # (a regular file takes it whole but on a full disk or a signal)
            view = memoryview(body)[written:]
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _no_constant(name: str) -> Any:
    """NaN and Infinity: Python reads them, but they are not JSON, and the server would refuse them."""
    raise ValueError(f"{name} is not a JSON value")


def plainly_empty(path: str) -> bool:
    """Whether ``path`` is an empty regular file (not a symbolic link) that this process could open
    for reading: what an open with ``O_NOFOLLOW`` and an ``fstat`` would find, told by one ``lstat``
    (each system call gives up the GIL and must win it back behind the runner's other threads).
    False for anything else, which the caller then opens and reads as before."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size:
        return False
    euid = os.geteuid()
    return euid == 0 or (st.st_uid == euid and bool(st.st_mode & stat.S_IRUSR))


def read_output_file(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """Read and check the JSON object a child left in ``path`` (see ``TaskFiles.read_output``)."""
    name = "CONDUCTOR_OUTPUT_FILE"
    if plainly_empty(path):  # most tasks write nothing: one lstat, not an open, an fstat and a close
        return None, None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the child could point it at any file of ours
            return None, f"{name} is a symbolic link (not followed): write the JSON into the file itself"
        return None, f"{name} could not be read: {exc.strerror}"
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        return None, f"{name} is not a regular file"
    if status.st_size == 0:  # nothing written (most tasks): no read (a regular file's size is exact)
        os.close(fd)
        return None, None
    chunks: list[bytes] = []
    size = 0
    try:  # plain reads up to one byte over the limit (os.fdopen would add three syscalls per task)
        while size <= OUTPUT_FILE_LIMIT_BYTES:
            chunk = os.read(fd, OUTPUT_FILE_LIMIT_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > OUTPUT_FILE_LIMIT_BYTES:  # only the first limit + 1 bytes were read: the size from fstat
        size = max(status.st_size, len(data))
        return None, too_large(name, size, OUTPUT_FILE_LIMIT_BYTES)
    if not data.strip():
        return None, None
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except ValueError as exc:
        return None, f"{name} is not valid JSON: {exc}"
    except RecursionError:  # a few KB of brackets: not a ValueError
        return None, f"{name} is not valid JSON: nested too deeply"
    if not isinstance(value, dict):
        kind = "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
        return None, f"{name} must hold a JSON object, not {kind}"
    if deeper_than(value, OUTPUT_MAX_DEPTH):  # the report adds levels and stack frames: a margin
        return None, f"{name} is not valid JSON: nested too deeply (over {OUTPUT_MAX_DEPTH} levels)"
    size = json_size(value)  # 256 levels serialise without a RecursionError
    if size > OUTPUT_FILE_LIMIT_BYTES:
        return None, too_large(f"{name} once serialised", size, OUTPUT_FILE_LIMIT_BYTES)
    return value, None
