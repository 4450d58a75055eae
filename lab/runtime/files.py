"""Writing files so that a reader never sees half of one, and checking a folder can be written.

Everything the lab writes (run directories, checkpoints' metadata, prepared data, caches) goes
through a temporary file in the same folder and a rename. JSON is strict: NaN and infinities are
written as null, never as the ``NaN``/``Infinity`` tokens that other JSON readers reject.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from lab.runtime.config import ConfigError


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a text (or binary) file through a uniquely named temporary file in the same folder and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
