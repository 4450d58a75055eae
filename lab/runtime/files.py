"""Writing files so that a reader never sees half of one, and checking a folder can be written.

Everything the lab writes (run directories, checkpoints' metadata, prepared data, caches) goes
through a temporary file in the same folder and a rename. JSON is strict: NaN and infinities are
written as null, never as the ``NaN``/``Infinity`` tokens that other JSON readers reject.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
from pathlib import Path
from typing import IO, Any

from lab.runtime.config import ConfigError


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a text (or binary) file through a uniquely named temporary file in the same folder and a rename,
    durably: the file's bytes reach the disk before the rename, and the rename before this returns."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is the process id it wrote ('?' if none)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def take_lock(path: Path) -> IO[str]:
    """Hold an exclusive lock on ``path`` (created if missing) until the returned file is closed, with this
    process's id written in it; LockHeld if another process holds it. The kernel releases it when the process
    dies, however it dies."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise LockHeld(holder) from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text (NaN and infinities become null)."""
    return json.dumps(strict_json(obj), allow_nan=False, **kwargs)


def save_json(path: str | Path, obj: Any) -> None:
    """Write strict JSON atomically."""
    write_atomic(Path(path), dumps(obj, indent=2) + "\n")


class UnreadableFile(ValueError):
    """A file that is not what it should hold (not UTF-8 text, not JSON); the message is one line naming it."""


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; UnreadableFile (one line) when it is not UTF-8 text or not JSON (OSError passes)."""
    data = Path(path).read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {e.start} of {len(data)})") from None
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{path}: not JSON ({e.msg}, line {e.lineno} column {e.colno})") from None


def read_lines(path: Path) -> list[str]:
    """The lines of a text file of records (metrics.jsonl): a byte that is not UTF-8 spoils its own line only, which
    the reader then skips or reports like any line that is not JSON."""
    return Path(path).read_bytes().decode("utf-8", errors="replace").splitlines()


def probe_writable(path: Path, what: str) -> None:
    """ConfigError (one line) unless ``path`` is, or could be created as, a folder this process can write.

    Nothing is created: the nearest existing ancestor must be a folder that accepts a temporary file.
    """
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise ConfigError(f"{what} {path} {where}, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{what} {path} is not writable ({e.strerror or e})") from None


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
