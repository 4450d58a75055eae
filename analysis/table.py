"""Load a table of training runs, map its columns and validate it.

Accepted inputs: a ``.csv``, ``.parquet``, ``.json`` (a list of records or ``{"runs": [...]}``)
or ``.jsonl`` file, or a sweep folder. A sweep folder is either read from a ``results.csv`` at
its top or searched recursively for run directories holding ``summary.json`` (and usually
``metrics.jsonl``, whose curves feed the envelope approach).

Every problem with the input raises :class:`InputError` with a one-line message, before any
fitting starts. Runs can be left out by id or by a pandas query condition (``exclude``) and the
``drop_highest_loss`` highest losses dropped; the table records what was dropped and why. Two checks
look at the rows together: runs with the same N and D (repeats, or runs at one N and D on different
unique data) are each kept as their own point, as the published fits do, with a warning giving
their spread (a note instead for seed replicates: runs sharing an ``experiment``, ``RunTable.experiments``),
or averaged into one run, or refused (``duplicates``); and the FLOPs column is
compared with k*N*D for one k fitted to the whole table (the median of C/(N D)), flagging rows
that are off by more than ``FLOPS_OUTLIER_FACTOR``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import conditions
from lab.runtime.files import RECORDS_MAX_BYTES, loads_line, read_json, read_lines, read_plain, unprintable
from lab.runtime.scores import task_columns

# Columns a table can provide after mapping; any two of params, tokens and flops suffice.
CANONICAL = ("params", "params_non_embedding", "tokens", "flops", "loss", "run_id", "unique_tokens")
PARAMS_COUNTS = ("total", "non_embedding")
# The smallest form of L(N, D) (one shared exponent) has four free parameters, so a fit needs at least five runs
# (the five-parameter forms six: analysis.fit leaves them out below that).
MIN_RUNS = 5
LARGEST_VALUE = 1e40  # far above any run's parameters, tokens or FLOPs; beyond it the fit's products overflow
SUMMARY_KEYS = ("params", "params_non_embedding", "tokens", "flops")
# Runs sharing N and D: each its own point (the literature's estimators fit every run), averaged, or refused.
DUPLICATE_POLICIES = ("keep", "mean", "refuse")
DUPLICATE_ALIASES = {"aggregate": "mean"}  # the name "mean" had before "keep" became the default
# A row whose C/(N D) differs from the table's k by more than this factor is flagged: the lab's own
# FLOPs (6N plus attention per token) vary by well under this across model shapes.
FLOPS_OUTLIER_FACTOR = 2.0
# k outside this range means FLOPs and N do not describe the same model (units, or N without embeddings).
FLOPS_K_PLAUSIBLE = (4.0, 12.0)


class InputError(ValueError):
    """Unusable input; the message is one line meant for the user."""


@dataclass
class Curve:
    """A training curve of one run: loss against the FLOPs spent so far."""

    row: int  # position of the run in RunTable.runs
    params: float
    flops: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray


@dataclass
class RunTable:
    """Validated runs (columns run_id, params, tokens, flops, loss) plus what was learnt loading them."""

    runs: pd.DataFrame
    source: str
    params_count: str  # "total", "non_embedding", or "derived (C/6D)"
    curves: list[Curve] = field(default_factory=list)
    loss_source: str = "column 'loss'"  # where each run's loss came from
    curve_loss: str | None = None  # "eval" or "train"
    notes: list[str] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (code, message)
    flops_k: float = 6.0  # C = k N D, k the median over the runs
    flops_derived: bool = False  # the table had no FLOPs column
    flops_outliers: list[dict] = field(default_factory=list)  # {"run_id", "ratio"}: C / (k N D)
    duplicates: list[dict] = field(default_factory=list)  # {"params", "tokens", "run_ids", "loss_spread", ...}
    duplicate_policy: str = "keep"
    dropped: list[dict] = field(default_factory=list)  # {"run_id", "params", "tokens", "loss", "reason"}
    side_runs: str | None = None  # the one line that says which search or verify rows were left out

    @property
    def n(self) -> np.ndarray:
        return self.runs["params"].to_numpy(float)

    @property
    def d(self) -> np.ndarray:
        return self.runs["tokens"].to_numpy(float)

    @property
    def c(self) -> np.ndarray:
        return self.runs["flops"].to_numpy(float)

    @property
    def loss(self) -> np.ndarray:
        return self.runs["loss"].to_numpy(float)

    @property
    def experiments(self) -> np.ndarray | None:
        """Each run's experiment as an integer (runs sharing one are seed replicates: same config, another seed), or
        None when the table has no ``experiment`` column; a run without one is an experiment of its own."""
        if "experiment" not in self.runs.columns:
            return None
        names = self.runs["experiment"].astype(object).where(self.runs["experiment"].notna(), None)
        unique = [f"\0row {i}" if e is None or e == "" else str(e) for i, e in enumerate(names)]
        return pd.factorize(pd.Series(unique))[0].astype(int)

    @property
    def replicate_weights(self) -> np.ndarray | None:
        """Each run's weight in approach 3, 1 / its experiment's seed replicates, so that every experiment counts once
        however many seeds it has; None when no run has a replicate."""
        experiments = self.experiments
        if experiments is None:
            return None
        count = np.bincount(experiments)[experiments]
        return None if np.all(count == 1) else 1.0 / count

    @property
    def dataset(self) -> str | None:
        """The data set every run names in a ``dataset`` column, or None (no column, gaps or several)."""
        if "dataset" not in self.runs.columns or self.runs["dataset"].isna().any():
            return None
        names = self.runs["dataset"].astype(str).unique()
        return str(names[0]) if len(names) == 1 else None


def parse_column_map(items: list[str] | None) -> dict[str, str]:
    """Parse ``NAME=COLUMN`` items (NAME one of CANONICAL) into ``{NAME: COLUMN}``."""
    mapping: dict[str, str] = {}
    for item in items or []:
        name, sep, column = item.partition("=")
        name, column = name.strip(), column.strip()
        if not sep or not name or not column:
            raise InputError(f"bad column mapping '{item}': expected NAME=COLUMN, e.g. params=n_params")
        if name not in CANONICAL:
            raise InputError(f"bad column mapping '{item}': NAME must be one of {', '.join(CANONICAL)}")
        mapping[name] = column
    return mapping


def load_runs(path: str | Path, columns: dict[str, str] | None = None,
              params_count: str | None = None, duplicates: str = "keep", exclude: tuple[str, ...] | list[str] = (),
              drop_highest_loss: int = 0, side_runs: bool = False) -> RunTable:
    """Read, map and validate the runs at ``path``.

    ``columns`` maps canonical names to the table's own column names. ``params_count`` picks
    the parameter count when both ``params`` and ``params_non_embedding`` are present (default
    total); ``None`` means total if present, else non-embedding. ``exclude`` items are run ids or
    pandas query conditions on the mapped columns (``loss > 4``); the runs they match are dropped,
    then the ``drop_highest_loss`` runs with the highest loss. ``duplicates`` says what to do with
    runs sharing N and D: keep each as its own point ("keep"), average them ("mean") or raise ("refuse").
    Rows whose ``role`` column marks them as a sweep's search or verify runs are left out (as they are from a
    sweep folder) unless ``side_runs``; ``RunTable.side_runs`` then says so in one line.
    """
    path = Path(path)
    if params_count is not None and params_count not in PARAMS_COUNTS:
        raise InputError(f"--params-count must be one of {', '.join(PARAMS_COUNTS)}, got '{params_count}'")
    duplicates = DUPLICATE_ALIASES.get(duplicates, duplicates)
    if duplicates not in DUPLICATE_POLICIES:
        raise InputError(f"--duplicates must be one of {', '.join(DUPLICATE_POLICIES)}, got '{duplicates}'")
    if drop_highest_loss < 0:
        raise InputError(f"--drop-highest-loss must be >= 0, got {drop_highest_loss}")
    warnings: list[tuple[str, str]] = []
    notes: list[str] = []
    run_dirs: list[Path | None] = []
    if path.is_dir():
        frame, run_dirs, loss_sources = _read_sweep(path, warnings)
    elif path.is_file():
        frame, loss_sources = _read_file(path), None
    else:
        raise InputError(f"no such file or directory: {path}")
    frame = _apply_mapping(frame, columns or {})
    if "run_id" not in frame.columns:
        frame["run_id"] = [f"row {i + 1}" for i in range(len(frame))]
    # every id a str (pandas' string dtype keeps an empty cell as NaN: such a run is named by its row)
    frame["run_id"] = [f"row {i + 1}" if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
                       else str(v) for i, v in enumerate(frame["run_id"].to_numpy(object))]
    _printable([*map(str, frame.columns), *frame["run_id"]])
    keep = _completed(frame, warnings)
    side_note = None
    if not side_runs:
        side, side_note = _side_rows(frame)
        keep = keep & ~side  # not in place: _completed may return a read-only view of the frame
    frame = frame[keep].reset_index(drop=True)
    if run_dirs:
        run_dirs = [d for d, k in zip(run_dirs, keep) if k]
    if loss_sources is not None:
        loss_sources = [s for s, k in zip(loss_sources, keep) if k]
        train_only = [r for r, s in zip(frame["run_id"], loss_sources) if s == "train"]
        if train_only:
            warnings.append(("eval_loss_missing", f"{len(train_only)} run(s) have no final eval loss; "
                             f"used their final train loss: {_preview(train_only)}"))
    runs, count = _validate(frame, params_count, notes)
    kept, dropped = _select(runs, list(exclude), drop_highest_loss)
    runs = runs[kept].reset_index(drop=True)
    if run_dirs:
        run_dirs = [d for d, k in zip(run_dirs, kept) if k]
    if loss_sources is not None:
        loss_sources = [s for s, k in zip(loss_sources, kept) if k]
    table = RunTable(runs=runs, source=str(path), params_count=count, notes=notes, warnings=warnings,
                     flops_derived="flops derived as 6ND" in notes, duplicate_policy=duplicates, dropped=dropped,
                     side_runs=side_note)
    if loss_sources is not None:
        table.loss_source = "final_eval_loss of summary.json" + (" (final_train_loss where eval was null)"
                                                                  if "train" in loss_sources else "")
    elif columns and "loss" in columns:
        table.loss_source = f"column '{columns['loss']}'"
    if path.is_dir():
        _attach_curves(table, run_dirs)
    merged = _merge_duplicates(table, duplicates)
    _check_size(table.runs, merged)
    _check_flops(table)
    return table


def _select(runs: pd.DataFrame, exclude: list[str], drop_highest_loss: int) -> tuple[np.ndarray, list[dict]]:
    """Rows to keep, and a record of each dropped run with the reason (an --exclude item or the highest losses)."""
    keep = np.ones(len(runs), bool)
    reasons: dict[int, str] = {}
    ids = runs["run_id"].to_numpy()
    for item in exclude:
        hit = ids == item
        if not hit.any():
            try:
                hit = conditions.evaluate(item, runs)
            except (conditions.ConditionError, TypeError) as exc:  # TypeError: text compared with numbers
                raise InputError(f"--exclude '{item}': no run has that id, and it is not a condition on the "
                                 f"columns ({_one_line(exc)})") from exc
            if hit.dtype != bool or hit.shape != keep.shape:
                raise InputError(f"--exclude '{item}': no run has that id, and it is not a true/false condition")
        for i in np.flatnonzero(hit & keep):
            reasons[int(i)] = f"--exclude {item}"
        keep &= ~hit
    if drop_highest_loss:
        if drop_highest_loss >= keep.sum():
            raise InputError(f"--drop-highest-loss {drop_highest_loss} would drop every one of the {keep.sum()} runs")
        loss = runs["loss"].to_numpy(float)
        order = np.argsort(np.where(keep, -loss, np.inf), kind="stable")[:drop_highest_loss]
        for i in order:
            reasons[int(i)] = f"--drop-highest-loss {drop_highest_loss}"
        keep[order] = False
    dropped = [{"run_id": str(ids[i]), "params": float(runs["params"].iloc[i]), "tokens": float(runs["tokens"].iloc[i]),
                "loss": float(runs["loss"].iloc[i]), "reason": reasons[i]} for i in sorted(reasons)]
    return keep, dropped


def _printable(names: list[str]) -> None:
    """InputError (one line) for a column name or run id with a control or line-separator character: every one
    reaches the printed lines and reports, where it would break or forge a line."""
    bad = next((name for name in names if unprintable(name) is not None), None)
    if bad is not None:
        raise InputError(f"the column name or run_id {bad[:80]!r} holds the control character {unprintable(bad)!r}")


def _preview(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _read_file(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            return pd.read_csv(io.BytesIO(read_plain(path, RECORDS_MAX_BYTES)))
        if suffix == ".parquet":
            return pd.read_parquet(io.BytesIO(read_plain(path, RECORDS_MAX_BYTES)))
        if suffix == ".jsonl":
            return pd.DataFrame(_read_jsonl_records(path))
        if suffix == ".json":
            data = read_json(path, follow=True)
            if isinstance(data, dict) and isinstance(data.get("runs"), list):
                data = data["runs"]
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise InputError(f"{path}: expected a list of run records or {{\"runs\": [...]}}")
            return pd.DataFrame(data)
    except InputError:
        raise
    except (ValueError, OSError, ImportError) as exc:  # parser errors, unreadable files
        raise InputError(f"cannot read {path}: {_one_line(exc)}") from exc
    raise InputError(f"{path}: unsupported table format '{suffix}' (use .csv, .parquet, .json or .jsonl)")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def metrics_lines(metrics: Path) -> list[str]:
    """The lines of a run's metrics.jsonl (none when it is missing); InputError (one line) when it is a link, a FIFO
    or anything but a plain file of bounded size (``read_lines``)."""
    if not (metrics.exists() or metrics.is_symlink()):
        return []
    try:
        return read_lines(metrics)
    except OSError as exc:
        raise InputError(f"{metrics}: cannot read ({exc.strerror or exc})") from None


def step_records(metrics: Path) -> list[dict]:
    """The records of a run's metrics.jsonl that are JSON objects with an integer step, in order (other lines, a
    torn last one, are skipped)."""
    records = []
    for line in metrics_lines(metrics):
        try:
            record = loads_line(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _read_jsonl_records(path: Path) -> list[dict]:
    records = []
    for i, line in enumerate(read_lines(path, follow=True), 1):
        if not line.strip():
            continue
        try:
            record = loads_line(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise InputError(f"{path}:{i}: expected a JSON object per line")
        records.append(record)
    return records


# sub-folders of a sweep folder whose runs are not the sweep's grid (and those runs' role): a hyperparameter search,
# verify runs, and the stable phases that cooldown branches start from (sweeps.cooldowns)
SWEEP_SIDE_RUNS = ("search", "verify", "parent")


def _read_sweep(root: Path, warnings: list[tuple[str, str]]
                ) -> tuple[pd.DataFrame, list[Path | None], list[str] | None]:
    """A sweep folder as a table, the run directory of each row, and each row's loss source."""
    results = root / "results.csv"
    if results.is_file():
        frame = _read_file(results)
        if "run_dir" in frame.columns:
            dirs = [None if pd.isna(d) else _resolve(root, str(d)) for d in frame["run_dir"]]
        else:
            dirs = [None] * len(frame)
        return frame, dirs, None
    summaries = sorted(root.rglob("summary.json"))
    sweep = (root / "sweep.db").is_file()
    if sweep:  # a sweep's folder: its hyperparameter search and verify runs are not its grid
        summaries = [s for s in summaries if s.relative_to(root).parts[0] not in SWEEP_SIDE_RUNS]
    if not summaries:
        raise InputError(f"{root}: no results.csv and no run directories (summary.json) inside")
    rows, dirs, sources, unusable = [], [], [], []
    for summary_path in summaries:
        try:
            summary = read_json(summary_path)
        except (ValueError, OSError) as exc:
            raise InputError(f"{summary_path}: cannot read ({_one_line(exc)})") from exc
        if not isinstance(summary, dict):
            raise InputError(f"{summary_path}: expected a JSON object")
        where = summary_path.parent.relative_to(root)
        # in a sweep's folder a run is named as the sweep names it (runs/NAME): the id --exclude takes
        run_id = where.name if sweep and where.parent == Path("runs") else str(where)
        row = {"run_id": run_id, "status": summary.get("status")}
        loss, source = summary.get("final_eval_loss"), "eval"
        if loss is None:
            loss, source = summary.get("final_train_loss"), "train"
        if summary.get("status") == "completed":
            missing = [k for k in SUMMARY_KEYS if k not in summary]
            if missing:
                raise InputError(f"{summary_path}: missing key(s) {', '.join(missing)}")
            if loss is None:
                unusable.append(run_id)
                continue
        row.update({k: summary.get(k) for k in SUMMARY_KEYS})
        row.update(loss=loss, dataset=summary.get("dataset"), strategy=summary.get("strategy"),
                   world_size=summary.get("world_size"), wall_time_s=summary.get("wall_time_s"),
                   params_active=summary.get("params_active", summary.get("params")),
                   flops_per_token=summary.get("flops_per_token"), **{
                       k: summary.get(k, v) for k, v in (("moe_experts", 0), ("moe_top_k", 1), ("moe_granularity", 1))})
        row.update(task_columns(summary_path.parent), experiment=_experiment(summary_path.parent))
        rows.append(row)
        dirs.append(summary_path.parent)
        sources.append(source)
    if unusable:
        warnings.append(("runs_skipped", f"skipped {len(unusable)} completed run(s) with neither an eval "
                         f"nor a train loss: {_preview(unusable)}"))
    return pd.DataFrame(rows), dirs, sources


def _experiment(run_dir: Path) -> str | None:
    """What a run computes apart from its seed and layout (its config.json without ``train.seed``, ``parallel`` and
    ``log``), as a short hash: runs that share it are seed replicates of one experiment. None without a config."""
    try:
        config = read_json(run_dir / "config.json")
    except (ValueError, OSError):
        return None
    if not isinstance(config, dict):
        return None
    kept = {k: v for k, v in config.items() if k not in ("parallel", "log")}
    if isinstance(kept.get("train"), dict):
        kept["train"] = {k: v for k, v in kept["train"].items() if k != "seed"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def _resolve(root: Path, run_dir: str) -> Path:
    p = Path(run_dir)
    return p if p.is_absolute() else root / p


def _apply_mapping(frame: pd.DataFrame, mapping: dict[str, str]) -> pd.DataFrame:
    missing = [f"{k}={v}" for k, v in mapping.items() if v not in frame.columns]
    if missing:
        raise InputError(f"column mapping {', '.join(missing)}: no such column in the table "
                         f"(columns: {', '.join(map(str, frame.columns))})")
    sources = set(mapping.values())
    # A canonical name that is remapped from another column is replaced, not duplicated.
    drop = [k for k, v in mapping.items() if k in frame.columns and k != v and k not in sources]
    frame = frame.drop(columns=drop)
    selected = frame[list(mapping.values())].copy()
    selected.columns = list(mapping.keys())
    rest = frame.drop(columns=[c for c in frame.columns if c in sources or c in mapping])
    return pd.concat([rest, selected], axis=1)


def _completed(frame: pd.DataFrame, warnings: list[tuple[str, str]]) -> np.ndarray:
    """Rows to keep: those with status 'completed' when the table has a status column."""
    if "status" not in frame.columns:
        return np.ones(len(frame), bool)
    keep = (frame["status"] == "completed").to_numpy()
    skipped = [f"{r} ({s})" for r, s, k in zip(frame["run_id"], frame["status"], keep) if not k]
    if skipped:
        warnings.append(("runs_skipped", f"skipped {len(skipped)} run(s) not completed: {_preview(skipped)}"))
    return keep


def _side_rows(frame: pd.DataFrame) -> tuple[np.ndarray, str | None]:
    """Rows a sweep marks (``role`` column) as its search or verify runs, and the line that says they are left out."""
    if "role" not in frame.columns:
        return np.zeros(len(frame), bool), None
    roles = frame["role"].astype(str)
    side = roles.isin(SWEEP_SIDE_RUNS).to_numpy()
    if not side.any():
        return side, None
    counts = ", ".join(f"{n} {role}" for role, n in roles[side].value_counts().sort_index().items())
    return side, (f"left out {counts} row(s) (column role): a sweep's search and verify runs are not its grid; "
                  f"--side-runs fits them too")


def _numeric(frame: pd.DataFrame, column: str) -> np.ndarray:
    raw = frame[column]
    values = pd.to_numeric(raw, errors="coerce").to_numpy(float)
    ids = frame["run_id"].to_numpy()
    bad_type = np.isnan(values) & raw.notna().to_numpy()
    if bad_type.any():
        i = int(np.flatnonzero(bad_type)[0])
        raise InputError(f"column '{column}' has {int(bad_type.sum())} non-numeric value(s) "
                         f"({ids[i]}: {raw.iloc[i]!r})")
    nan = np.isnan(values)
    if nan.any():
        raise InputError(f"column '{column}' has {int(nan.sum())} missing or NaN value(s) "
                         f"({_preview(list(ids[nan]))})")
    inf = np.isinf(values)
    if inf.any():
        raise InputError(f"column '{column}' has {int(inf.sum())} infinite value(s) ({_preview(list(ids[inf]))})")
    bad = values <= 0
    if bad.any():
        raise InputError(f"column '{column}' has {int(bad.sum())} non-positive value(s) "
                         f"({_preview(list(ids[bad]))}); every value must be > 0")
    huge = values > LARGEST_VALUE
    if huge.any():
        raise InputError(f"column '{column}' has {int(huge.sum())} value(s) above {LARGEST_VALUE:g} "
                         f"({_preview(list(ids[huge]))}); no run has such a size (a unit or a typo?)")
    return values


def _validate(frame: pd.DataFrame, params_count: str | None, notes: list[str]) -> tuple[pd.DataFrame, str]:
    cols = set(frame.columns)
    has_total, has_nonemb = "params" in cols, "params_non_embedding" in cols
    if params_count == "non_embedding" and not has_nonemb:
        raise InputError("--params-count non_embedding needs a 'params_non_embedding' column "
                         "(map one with --column params_non_embedding=NAME)")
    if params_count == "total" and not has_total and has_nonemb:
        raise InputError("--params-count total needs a 'params' column (the table only has "
                         "'params_non_embedding')")
    if params_count is None:
        params_count = "total" if has_total or not has_nonemb else "non_embedding"
    n_col = "params" if params_count == "total" else "params_non_embedding"
    present = [c for c in (n_col, "tokens", "flops") if c in cols]
    if "loss" not in cols or len(present) < 2:
        found = ", ".join(map(str, frame.columns)) or "none"
        raise InputError(f"missing column(s): need 'loss' and two of 'params', 'tokens', 'flops' "
                         f"(found: {found}); map other names with --column NAME=COLUMN")
    values = {c: _numeric(frame, c) for c in present + ["loss"]}
    if n_col != "params":
        notes.append("N is the non-embedding parameter count")
    if n_col not in values:
        values[n_col] = values["flops"] / (6.0 * values["tokens"])
        params_count = "derived (C/6D)"
        notes.append("params derived as C/(6D)")
    if "tokens" not in values:
        values["tokens"] = values["flops"] / (6.0 * values[n_col])
        notes.append("tokens derived as C/(6N)")
    if "flops" not in values:
        values["flops"] = 6.0 * values[n_col] * values["tokens"]
        notes.append("flops derived as 6ND")
    runs = frame.drop(columns=[c for c in ("params", "params_non_embedding", "tokens", "flops", "loss")
                               if c in cols])
    runs.insert(0, "params", values[n_col])
    runs.insert(1, "tokens", values["tokens"])
    runs.insert(2, "flops", values["flops"])
    runs.insert(3, "loss", values["loss"])
    runs.insert(0, "run_id", runs.pop("run_id"))
    return runs, params_count


def _check_size(runs: pd.DataFrame, merged: int) -> None:
    after = f" after merging {merged} duplicate run(s)" if merged else ""
    if len(runs) < MIN_RUNS:
        raise InputError(f"need at least {MIN_RUNS} runs for a fit, got {len(runs)}{after}")
    for name in ("params", "tokens"):
        if len(np.unique(runs[name])) < 2:
            raise InputError(f"the parametric fit needs at least 2 distinct values of {name}, "
                             f"got {len(np.unique(runs[name]))}")


def _log_key(values: np.ndarray) -> np.ndarray:
    """Values equal to 1e-9 relative precision map to the same integer."""
    return np.round(np.log(values) * 1e9).astype(np.int64)


def replicate_means(loss: np.ndarray, weights: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(B, runs): each run's ``loss`` averaged, with ``weights`` (B, runs), over the drawn runs (weight > 0) of its
    group (integers: one experiment's seed replicates); inf where a row does not draw the run."""
    _, which = np.unique(groups, return_inverse=True)
    which = which.ravel()
    total = np.zeros((len(weights), which.max(initial=-1) + 1))
    count = np.zeros_like(total)
    np.add.at(total.T, which, (weights * loss).T)
    np.add.at(count.T, which, weights.T)
    return np.where(weights > 0, (total / np.where(count > 0, count, 1.0))[:, which], np.inf)


def _summary(ids: np.ndarray, repeated: list[np.ndarray]) -> str:
    """How many runs share N and D with another, with up to three groups as examples."""
    examples = "; ".join(" = ".join(ids[rows[:3]]) + (" ..." if len(rows) > 3 else "") for rows in repeated[:3])
    return (f"{sum(len(r) for r in repeated)} runs share N and D with another run "
            f"({len(repeated)} group(s): {examples}{' ...' if len(repeated) > 3 else ''})")


def _spread(groups: list[dict]) -> str:
    """The loss range within groups of runs sharing N and D: median and largest, with the largest's runs."""
    spreads = np.array([g["loss_range"] for g in groups])
    worst = groups[int(np.argmax(spreads))]
    return (f"loss range within a group: median {np.median(spreads):.3g}, largest {spreads.max():.3g} nats "
            f"({worst['loss_spread']:.2%}, {' = '.join(worst['run_ids'][:3])})")


def _merge_duplicates(table: RunTable, policy: str) -> int:
    """Runs that share N and D: keep each (warned with their spread, unless the group is one experiment's seed
    replicates, which a note reports as the seed noise), average each group into one run (curves kept), or refuse
    them. Returns how many rows averaging removed."""
    runs = table.runs
    keys = pd.DataFrame({"n": _log_key(table.n), "d": _log_key(table.d)})
    group = keys.groupby(["n", "d"], sort=False).ngroup().to_numpy()
    counts = np.bincount(group)
    if counts.max(initial=1) == 1:  # no runs at all is the size check's to refuse
        return 0
    repeated = [np.flatnonzero(group == g) for g in np.flatnonzero(counts > 1)]
    ids = runs["run_id"].to_numpy()
    summary = _summary(ids, repeated)
    if policy == "refuse":
        raise InputError(f"duplicate runs: {summary}; keep each with --duplicates keep or average them with "
                         "--duplicates mean")
    loss = table.loss
    experiments = table.experiments
    table.duplicates = [{"params": float(table.n[r[0]]), "tokens": float(table.d[r[0]]),
                         "run_ids": [str(i) for i in ids[r]], "loss_range": float(loss[r].max() - loss[r].min()),
                         "loss_std": float(loss[r].std(ddof=1)),
                         "loss_spread": float((loss[r].max() - loss[r].min()) / loss[r].mean()),
                         "replicates": experiments is not None and len(np.unique(experiments[r])) == 1}
                        for r in repeated]
    if policy == "keep":
        replicates = [g for g in table.duplicates if g["replicates"]]
        if replicates:
            table.notes.append(f"{sum(len(g['run_ids']) for g in replicates)} runs are seed replicates ("
                               f"{len(replicates)} experiment(s) run with more than one seed), each kept as its own "
                               f"point; the seed noise, {_spread(replicates)}")
        unexplained = [rows for rows, g in zip(repeated, table.duplicates) if not g["replicates"]]
        if unexplained:
            others = [g for g in table.duplicates if not g["replicates"]]
            table.warnings.append(("duplicates", f"{_summary(ids, unexplained)}: each is kept as its own point, as "
                                   f"the published fits do; {_spread(others)}. Average each group with "
                                   "--duplicates mean if they are repeats of one experiment"))
        return 0
    first = np.unique(group, return_index=True)[1]
    merged = runs.iloc[first].reset_index(drop=True)
    merged["loss"] = np.bincount(group, weights=loss) / counts
    merged["flops"] = np.bincount(group, weights=table.c) / counts
    merged["run_id"] = [f"{i} (+{c - 1} repeat{'s' if c > 2 else ''})" if c > 1 else i
                        for i, c in zip(merged["run_id"], counts)]
    for curve in table.curves:
        curve.row = int(group[curve.row])
    table.warnings.append(("duplicates", f"{summary}: each group is averaged into one run (--duplicates mean), so it "
                           f"counts once in the fit and the bootstrap; {_spread(table.duplicates)}"))
    table.runs = merged
    return len(runs) - len(merged)


def _check_flops(table: RunTable) -> None:
    """Fit one k to C = k N D across the table; flag rows and a k that do not fit."""
    ratio = table.c / (table.n * table.d)
    table.flops_k = float(np.exp(np.median(np.log(ratio))))
    if table.flops_derived:
        return
    off = ratio / table.flops_k
    bad = np.flatnonzero(np.abs(np.log(off)) > np.log(FLOPS_OUTLIER_FACTOR))
    ids = table.runs["run_id"].to_numpy()
    table.flops_outliers = [{"run_id": str(ids[i]), "ratio": float(off[i])} for i in bad]
    if len(bad):
        shown = ", ".join(f"{ids[i]} ({off[i]:.3g}x)" for i in bad[:5]) + (" ..." if len(bad) > 5 else "")
        table.warnings.append(("flops_mismatch", f"{len(bad)} run(s) have FLOPs more than {FLOPS_OUTLIER_FACTOR:g}x "
                               f"off C = {table.flops_k:.3g} N D, the relation the other runs follow: {shown}; "
                               "their budget grouping and compute axis are suspect"))
    lo, hi = FLOPS_K_PLAUSIBLE
    if not lo <= table.flops_k <= hi:
        table.warnings.append(("flops_k", f"FLOPs are C = {table.flops_k:.3g} N D across the table, far from the "
                               "usual 6 N D: check the FLOPs units and whether N counts the same parameters"))


def _attach_curves(table: RunTable, run_dirs: list[Path | None]) -> None:
    """Read metrics.jsonl of each run into table.curves (eval loss when every curve has it)."""
    raw: list[tuple[int, dict[str, np.ndarray]]] = []
    bad_lines = 0
    for row, run_dir in enumerate(run_dirs):
        metrics = None if run_dir is None else run_dir / "metrics.jsonl"
        if metrics is None or not (metrics.exists() or metrics.is_symlink()):
            continue
        train, evals = [], []
        for line in metrics_lines(metrics):
            if not line.strip():
                continue
            try:
                rec = loads_line(line)
            except json.JSONDecodeError:
                bad_lines += 1
                continue
            tokens = rec.get("tokens") if isinstance(rec, dict) else None
            if not isinstance(tokens, (int, float)) or tokens <= 0:
                continue
            for key, out in (("loss", train), ("eval_loss", evals)):
                value = rec.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
                    out.append((float(tokens), float(value)))
        raw.append((row, {"train": np.array(train).reshape(-1, 2), "eval": np.array(evals).reshape(-1, 2)}))
    if bad_lines:
        table.warnings.append(("metrics_unreadable", f"ignored {bad_lines} unreadable line(s) in metrics.jsonl files"))
    if not raw:
        return
    kind = "eval" if all(len(r["eval"]) >= 2 for _, r in raw) else "train"
    table.curve_loss = kind
    for row, records in raw:
        points = records[kind]
        if len(points) < 2:
            continue
        points = points[np.argsort(points[:, 0], kind="stable")]
        run = table.runs.iloc[row]
        flops_per_token = run["flops"] / run["tokens"]
        table.curves.append(Curve(row=row, params=float(run["params"]), tokens=points[:, 0],
                                  flops=points[:, 0] * flops_per_token, loss=points[:, 1]))
