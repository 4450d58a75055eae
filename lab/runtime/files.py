"""Writing files so that a reader never sees half of one, and checking a folder can be written.

Everything the lab writes (run directories, checkpoints' metadata, prepared data, caches) goes
through a temporary file in the same folder and a rename. JSON is strict: NaN and infinities are
written as null, never as the ``NaN``/``Infinity`` tokens that other JSON readers reject.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from lab.runtime.config import ConfigError


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a text (or binary) file through a uniquely named temporary file in the same folder and a rename,
    durably: the file's bytes reach the disk before the rename, and the rename before this returns."""
    with replacing(path) as tmp:
        tmp.write_bytes(text) if isinstance(text, bytes) else tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` for the block to write; after it, the file's bytes are synced, it takes
    ``path``'s name and the rename is synced (it is removed instead when the block raises)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_file(path: Path) -> None:
    """Make the bytes of the file ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it) durable."""
    fsync_file(folder)


def fsync_tree(folder: Path) -> None:
    """Make every file and folder under ``folder`` durable (a copied tree, before it is renamed into place)."""
    for parent, _, names in os.walk(folder, topdown=False):
        for name in names:
            fsync_file(Path(parent) / name)
        fsync_folder(Path(parent))


def open_append(path: Path) -> IO[str]:
    """``path`` opened to append text (created if missing): never through a symbolic link and only as a plain file,
    so that an append lands in the run's own file and a FIFO cannot block it; OSError otherwise."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a plain file")
    return os.fdopen(fd, "a", encoding="utf-8")


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (created if missing, never through a link: ``open_append``),
    durably."""
    created = not path.exists()
    with open_append(path) as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    if created:
        fsync_folder(path.parent)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is the process id it wrote ('?' if none)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class LockUnusable(Exception):
    """A lock file that cannot serve as one (a link, not a plain file, a file system without locks); one line."""


def open_lock(path: Path) -> IO[bytes]:
    """``path`` opened for locking, created if missing: never through a symbolic link, and only as a plain file of
    one name (a hard link to another file would have it truncated); LockUnusable otherwise."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        handle = open(path, "r+b", opener=lambda name, _: os.open(name, flags, 0o644))
    except OSError as e:
        why = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror or e})"
        raise LockUnusable(f"the lock {path} {why}; it must be a plain file: remove it") from None
    info = os.fstat(handle.fileno())
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        handle.close()
        raise LockUnusable(f"the lock {path} is not a plain file of one name; remove it")
    return handle


def lock(handle: IO[bytes], wait: bool = False) -> bool:
    """Take an exclusive ``flock`` on an open lock file: True once held; False when another process holds it and
    ``wait`` is false; LockUnusable (one line) when the file system refuses locks (some Lustre and FUSE mounts)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as e:
        raise LockUnusable(f"the file system of {handle.name} refuses locks ({e.strerror or e}); put the run or "
                           f"sweep folder on a file system that supports flock (a local disk, NFS v4)") from None
    return True


def take_lock(path: Path) -> IO[bytes]:
    """Hold an exclusive lock on ``path`` (created if missing) until the returned file is closed, with this
    process's id written in it; LockHeld if another process holds it, LockUnusable (one line) if the file cannot
    be a lock (``open_lock``, ``lock``). The kernel releases it when the process dies, however it dies."""
    handle = open_lock(path)
    try:
        held = lock(handle)
    except LockUnusable:
        handle.close()
        raise
    if not held:
        holder = handle.read().decode(errors="replace").strip() or "?"
        handle.close()
        raise LockHeld(holder)
    handle.truncate(0)
    handle.write(str(os.getpid()).encode())
    handle.flush()
    return handle


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


JSON_MAX_BYTES = 256 * 2**20  # a run's or a fit's JSON is far smaller; anything larger is not one


def _open_plain(path: Path, follow: bool) -> IO[bytes]:
    """``path`` opened to read, without blocking on a FIFO or (unless ``follow``) following a link; OSError unless it
    is a plain file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file")
    return os.fdopen(fd, "rb")


def read_plain(path: Path, limit: int, follow: bool = True) -> bytes:
    """The bytes of the plain file ``path``, at most ``limit`` of them; OSError for anything else (a device, a FIFO,
    a symbolic link when ``follow`` is false, a larger file), so that a crafted path can neither block a reader nor
    fill its memory."""
    with _open_plain(path, follow) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes")
    return data


def read_tail(path: Path, size: int) -> bytes:
    """The last ``size`` bytes (or fewer) of the plain file ``path``, read as ``read_plain`` reads without
    following a link."""
    with _open_plain(path, follow=False) as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
        return fh.read(size)


class UnreadableFile(ValueError):
    """A file that is not what it should hold (not UTF-8 text, not JSON); the message is one line naming it."""


def read_json(path: Path, follow: bool = False) -> Any:
    """The JSON value in ``path``; UnreadableFile (one line) when it is not UTF-8 text or not JSON, OSError when it is
    not a plain file of at most JSON_MAX_BYTES (``read_plain``), or a symbolic link unless ``follow`` (a file the
    user names on the command line; never one of a run, sweep or checkpoint folder)."""
    data = read_plain(Path(path), JSON_MAX_BYTES, follow=follow)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {e.start} of {len(data)})") from None
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{path}: not JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise UnreadableFile(f"{path}: not JSON this lab writes (nested too deeply)") from None


def loads_line(line: str) -> Any:
    """The JSON value of one line of a records file or table; json.JSONDecodeError (a ValueError) for a line that is
    not JSON, one nested too deeply for the parser included, so that every reader skips or reports it as one."""
    try:
        return json.loads(line)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", line[:80], 0) from None


RECORDS_MAX_BYTES = 2 * 2**30  # a run's metrics.jsonl or a table of runs is far smaller; anything larger is not one


def read_lines(path: Path, limit: int = RECORDS_MAX_BYTES, follow: bool = False) -> list[str]:
    """The lines of a text file of records (metrics.jsonl): a byte that is not UTF-8 spoils its own line only, which
    the reader then skips or reports like any line that is not JSON. Read as ``read_plain`` reads, without
    following a link (unless ``follow``: a table the user names): OSError for a link, a FIFO, a device or a file
    over ``limit`` bytes."""
    return read_plain(Path(path), limit, follow=follow).decode("utf-8", errors="replace").splitlines()


def probe_writable(path: Path, what: str) -> None:
    """ConfigError (one line) unless ``path`` is, or could be created as, a folder this process can write.

    Nothing is created: the nearest existing ancestor must be a folder that accepts a temporary file. The path is
    checked first as every path the lab writes to (``check_path``).
    """
    existing = check_path(path, what)
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


NAME_MAX_BYTES = 255  # one component of a path, as Linux file systems allow
PATH_MAX_BYTES = 4000  # a whole path, under Linux's PATH_MAX of 4096


def unprintable(text: str) -> str | None:
    """The first character of ``text`` that would break a line of a script, a log or a job name (a C0 or C1
    control, DEL, U+2028 or U+2029), or None."""
    return next((c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029"), None)


def check_path(path: str | Path, what: str) -> Path:
    """``path`` as a Path; ConfigError (one line) when it holds a control or line-separator character
    (``unprintable``) or is longer than a file system takes (a component over NAME_MAX_BYTES, the whole over
    PATH_MAX_BYTES). The one rule for every name or path that reaches a script, a log line or a job name."""
    text = str(path)
    if (c := unprintable(text)) is not None:
        raise ConfigError(f"{what} {text!r} holds the control character {c!r}; names and paths the lab writes into "
                          f"scripts and logs must not")
    longest = max((len(part.encode(errors="surrogateescape")) for part in Path(text).parts), default=0)
    if longest > NAME_MAX_BYTES or len(text.encode(errors="surrogateescape")) > PATH_MAX_BYTES:
        raise ConfigError(f"{what} {text[:60]!r}... is too long (a name of at most {NAME_MAX_BYTES} bytes, a path "
                          f"of at most {PATH_MAX_BYTES})")
    return Path(text)


def refuse_foreign_folder(folder: Path, markers: tuple[str, ...], what: str, ignore: tuple[str, ...] = ()) -> None:
    """ConfigError (one line) when ``folder`` is a file or a link, or a folder that holds something (besides
    ``ignore``) but none of ``markers``, what a folder the lab wrote always holds: the lab writes into, and may
    replace, only an empty folder or one of its own, never a folder of the user's."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError(f"{what} {folder} is a file, not a folder")
    if not folder.exists() or any((folder / marker).exists() for marker in markers):
        return
    held = sorted(p.name for p in folder.iterdir() if p.name not in ignore)
    if held:
        raise ConfigError(f"{what} {folder} holds files the lab did not write ({', '.join(held[:3])}"
                          f"{', ...' if len(held) > 3 else ''}) and no {' or '.join(markers)}; choose an empty or "
                          f"new folder")


def check_plain_files(folder: Path, names: tuple[str, ...]) -> None:
    """ConfigError (one line) when one of ``names`` in ``folder`` exists as anything but a plain file (a symbolic
    link, a FIFO, a folder): the lab reads and appends to its own files only."""
    for name in names:
        path = folder / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ConfigError(f"{path} is not a plain file (a link, a FIFO or a folder); the lab reads and writes "
                              f"only its own files there: move it aside")


_RENAME_EXCHANGE = 2  # renameat2's flag: swap two paths in one step


def swap_folders(new: Path, out: Path) -> None:
    """Put the folder ``new`` in place of ``out`` in one step (Linux renameat2 RENAME_EXCHANGE); ``new`` then
    holds the old contents. Elsewhere, or where the filesystem cannot exchange, ``out`` is moved aside first."""
    if not out.exists():
        new.rename(out)
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
    renameat2 = getattr(libc, "renameat2", None)
    at_cwd = -100
    if renameat2 is not None and renameat2(at_cwd, os.fsencode(new), at_cwd, os.fsencode(out), _RENAME_EXCHANGE) == 0:
        return
    aside = new.with_name(new.name + "-old")
    out.rename(aside)
    new.rename(out)
    aside.rename(new)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
