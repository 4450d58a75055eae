"""The sweep's registry: one SQLite row per run in ``SWEEP/sweep.db``.

A row holds the run's name, config hash, status (planned, running, done, failed, interrupted: stopped
at a signal after saving a checkpoint, cancelled), run directory, planned row (JSON), attempt count,
the job of its latest attempt (a local process id or a SLURM job id), the error line of a failed or
interrupted run and the summary of a finished one; beside it, one row per attempt (its job and outcome).
Every change is one SQLite transaction, so killing the driver at any moment loses nothing already recorded. An
unreadable or foreign database is reported (:class:`RegistryError`) and never replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.runtime import chaos

from sweeps.runs import PlannedRun

DB_NAME = "sweep.db"
STATUSES = ("planned", "running", "done", "failed", "interrupted", "cancelled")
SCHEMA_VERSION = "2"  # 2 added the status 'interrupted'; a version 1 registry is upgraded when opened
_RUNS_TABLE = f"""
CREATE TABLE runs (
    name TEXT PRIMARY KEY,
    config_hash TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL CHECK (status IN ({", ".join(repr(s) for s in STATUSES)})),
    run_dir TEXT NOT NULL UNIQUE,
    plan TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    job TEXT,
    error TEXT,
    summary TEXT,
    position INTEGER NOT NULL,
    updated REAL NOT NULL
);
"""
# One row per attempt of a run, added in the transaction that counts it: its job and, once it ended, its outcome
# (none while it runs, or when its driver died before it ended). Added to older registries when they are opened.
_ATTEMPTS_TABLE = """
CREATE TABLE IF NOT EXISTS attempts (
    name TEXT NOT NULL,
    number INTEGER NOT NULL,
    job TEXT,
    outcome TEXT,
    started REAL NOT NULL,
    ended REAL,
    PRIMARY KEY (name, number)
);
"""
_SCHEMA = "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);" + _RUNS_TABLE + _ATTEMPTS_TABLE
_COLUMNS = ("name", "config_hash", "status", "run_dir", "plan", "attempts", "job", "error", "summary", "position",
            "updated")


class RegistryError(RuntimeError):
    """The registry cannot be used as it is; the message is one line."""


@dataclass(frozen=True)
class Row:
    name: str
    config_hash: str
    status: str
    run_dir: Path
    plan: PlannedRun
    attempts: int
    job: str | None
    error: str | None
    summary: dict[str, Any] | None

    @property
    def final_loss(self) -> float | None:
        """The run's final eval loss, else its final train loss; None without either."""
        s = self.summary or {}
        return s.get("final_eval_loss") if s.get("final_eval_loss") is not None else s.get("final_train_loss")


def _uri(path: Path, mode: str) -> str:
    return f"{path.absolute().as_uri()}?mode={mode}"


def _create(path: Path) -> None:
    """A new registry, built under a temporary name and linked into place (never over an existing file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    try:
        conn.executescript(_SCHEMA)
        with conn:
            conn.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
    finally:
        conn.close()
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # created meanwhile by another process: use that one
    finally:
        tmp.unlink()


class Registry:
    """A sweep's runs in SQLite; get one with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    @classmethod
    def open(cls, folder: Path, create: bool = False) -> "Registry":
        """The registry in ``folder``; with ``create``, a new empty one if there is none."""
        path = folder / DB_NAME
        if not path.exists():
            if not create:
                raise RegistryError(f"no sweep registry at {path} (run the sweep first)")
            _create(path)
        try:
            conn = sqlite3.connect(_uri(path, "rw"), uri=True, timeout=30, isolation_level=None)
            cls._check(conn, path)
            _upgrade(conn)
            conn.execute(_ATTEMPTS_TABLE)
        except sqlite3.DatabaseError as e:
            raise RegistryError(f"{path} is not a readable sweep registry ({e}); it was left as it is: "
                                f"move it aside to start the sweep afresh") from None
        return cls(conn)

    @staticmethod
    def _check(conn: sqlite3.Connection, path: Path) -> None:
        problems = [r[0] for r in conn.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise RegistryError(f"{path} is damaged ({problems[0]}); it was left as it is: move it aside to "
                                f"start the sweep afresh")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        columns = tuple(r[1] for r in conn.execute("PRAGMA table_info(runs)"))
        schema = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() if "meta" in tables else None
        if columns != _COLUMNS or schema not in (("1",), (SCHEMA_VERSION,)):
            raise RegistryError(f"{path} is not a sweep registry of this version; it was left as it is")

    # ------------------------------------------------------------ reading

    def rows(self) -> list[Row]:
        """Every run, in plan order."""
        cur = self._conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM runs ORDER BY position")
        return [_row(r) for r in cur]

    def get(self, name: str) -> Row | None:
        r = self._conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM runs WHERE name = ?", (name,)).fetchone()
        return _row(r) if r else None

    def meta(self, key: str) -> str | None:
        r = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return r[0] if r else None

    # ------------------------------------------------------------ writing

    def set_meta(self, key: str, value: str) -> None:
        self._conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def sync(self, runs: list[PlannedRun], run_dir: Callable[[str], Path]) -> None:
        """Record the planned runs: new ones as planned, known ones kept; all or nothing.

        A run whose recorded config differs is refused unless it never started (then it is updated);
        so is a config recorded under another name.
        """
        with _transaction(self._conn):
            next_position = self._conn.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM runs").fetchone()[0]
            for run in runs:
                known = self.get(run.name)
                other = self._conn.execute("SELECT name FROM runs WHERE config_hash = ? AND name != ?",
                                           (run.config_hash, run.name)).fetchone()
                if other:
                    raise RegistryError(f"run '{run.name}' has the same config as recorded run '{other[0]}'")
                if known is None:
                    self._conn.execute(
                        "INSERT INTO runs (name, config_hash, status, run_dir, plan, position, updated) "
                        "VALUES (?, ?, 'planned', ?, ?, ?, ?)",
                        (run.name, run.config_hash, str(run_dir(run.name)), json.dumps(run.to_dict()),
                         next_position, time.time()))
                    next_position += 1
                elif known.config_hash != run.config_hash:
                    if known.attempts:
                        raise RegistryError(
                            f"run '{run.name}' is recorded with a different config ({known.config_hash}, now "
                            f"{run.config_hash}) and has started; give the sweep a new name or folder")
                    self._conn.execute("UPDATE runs SET config_hash = ?, plan = ?, updated = ? WHERE name = ?",
                                       (run.config_hash, json.dumps(run.to_dict()), time.time(), run.name))

    def set_status(self, name: str, status: str, *, error: str | None = None,
                   summary: dict[str, Any] | None = None, job: str | None = None,
                   new_attempt: bool = False, unless: tuple[str, ...] = ()) -> bool:
        """Move a run to ``status`` unless it is in one of ``unless``, and record it in the run's latest attempt (a
        new one with ``new_attempt``), in one transaction; True if it changed."""
        assert status in STATUSES
        sql = ("UPDATE runs SET status = ?, error = ?, summary = COALESCE(?, summary), job = COALESCE(?, job), "
               "attempts = attempts + ?, updated = ? WHERE name = ?")
        now = time.time()
        params: list[Any] = [status, error, json.dumps(summary) if summary is not None else None, job,
                             int(new_attempt), now, name]
        if unless:
            sql += f" AND status NOT IN ({', '.join('?' * len(unless))})"
            params += list(unless)
        with _transaction(self._conn):
            if self._conn.execute(sql, params).rowcount != 1:
                return False
            number = self._conn.execute("SELECT attempts FROM runs WHERE name = ?", (name,)).fetchone()[0]
            if new_attempt:
                self._conn.execute("INSERT OR REPLACE INTO attempts (name, number, job, started) VALUES (?, ?, ?, ?)",
                                   (name, number, job, now))
            elif job is not None:
                self._conn.execute("UPDATE attempts SET job = ? WHERE name = ? AND number = ?", (job, name, number))
            if status not in ("planned", "running"):
                self._conn.execute("UPDATE attempts SET outcome = ?, ended = ? WHERE name = ? AND number = ? "
                                   "AND outcome IS NULL", (status, now, name, number))
        return True

    def attempts(self, name: str) -> list[dict[str, Any]]:
        """The recorded attempts of run ``name``, in order: number, job, outcome (None: never recorded as ended),
        started and ended times."""
        cur = self._conn.execute("SELECT number, job, outcome, started, ended FROM attempts WHERE name = ? "
                                 "ORDER BY number", (name,))
        return [dict(zip(("number", "job", "outcome", "started", "ended"), r)) for r in cur]


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        chaos.point("registry-transaction")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _upgrade(conn: sqlite3.Connection) -> None:
    """Rebuild a version 1 runs table (its CHECK lacks 'interrupted') as version 2, in one transaction."""
    def version() -> tuple | None:
        return conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()

    if version() != ("1",):
        return
    with _transaction(conn):
        if version() != ("1",):  # upgraded meanwhile by another process
            return
        conn.execute("ALTER TABLE runs RENAME TO runs_v1")
        conn.execute(_RUNS_TABLE)
        conn.execute(f"INSERT INTO runs SELECT {', '.join(_COLUMNS)} FROM runs_v1")
        conn.execute("DROP TABLE runs_v1")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (SCHEMA_VERSION,))


def _row(r: tuple) -> Row:
    d = dict(zip(_COLUMNS, r))
    try:
        plan, summary = json.loads(d["plan"]), json.loads(d["summary"]) if d["summary"] else None
        return Row(name=d["name"], config_hash=d["config_hash"], status=d["status"], run_dir=Path(d["run_dir"]),
                   plan=PlannedRun.from_dict(plan), attempts=d["attempts"], job=d["job"], error=d["error"],
                   summary=summary)
    except (TypeError, ValueError, KeyError) as e:
        raise RegistryError(f"the registry's row for run {d['name']!r} is damaged ({' '.join(str(e).split())[:200]}); "
                            f"it was left as it is") from None
