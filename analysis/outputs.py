"""A fit's outputs (fit.json, bootstrap.csv, figures, tables, reports), written into a staging folder
``.DIR.fit-staging-<pid>-*`` beside DIR and swapped with DIR in one step (DIR is replaced as a whole), so an
earlier fit in DIR is never lost, left half-written or mixed with the new one; SIGINT, SIGTERM and SIGHUP remove the
staging folder (``stopping_on_signals``), and a later fit removes any left by a process that no longer exists
(killed with SIGKILL). Also what the terminal shows of a fit (``summary_lines``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.allocate import LAW_COLUMNS
from analysis.compare import APPROACHES, TITLES, disagreement_note
from analysis.fit_result import FitResult
from analysis.forms import forms_cells
from analysis.other_laws import law_line
from analysis.parametric import named_samples
from analysis.table import InputError
from lab.measure.laws import FORMS
from lab.runtime.files import process_alive, refuse_foreign_folder, swap_folders

STAGING_PREFIX = ".fit-staging-"


def bootstrap_frame(result: FitResult) -> pd.DataFrame:
    """One row per resample: approach 3's parameters and every other approach's power law."""
    form = result.parametric.form
    samples = named_samples(result.thetas, form=form)
    columns = {k: samples[k] for k in form.names}
    for key in APPROACHES[:2]:
        law = result.approaches[key].samples
        if law is not None:
            columns.update({f"{key}_{c}": v for c, v in zip(LAW_COLUMNS, (law.a, law.k_n, law.b, law.k_d))})
    return pd.DataFrame(columns)


def _staging_prefix(out: Path) -> str:
    return f".{out.name}{STAGING_PREFIX}"


def remove_stale_staging(out: Path) -> None:
    """Remove staging folders beside ``out`` (and, from earlier versions, inside it) whose process is gone (or that
    carry no process id)."""
    for path in [*out.parent.glob(_staging_prefix(out) + "*"), *out.glob(STAGING_PREFIX + "*")]:
        match = re.match(r".*" + re.escape(STAGING_PREFIX) + r"(\d+)-", path.name)
        if match and process_alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)


def refuse_foreign_out(out: Path) -> None:
    """ConfigError (one line) unless ``out`` is missing, empty or a fit's outputs (it holds fit.json): the fit
    replaces ``out`` as a whole, so a folder of anything else (a sweep's, the user's) is never replaced."""
    refuse_foreign_folder(out, ("fit.json",), "--out")


def write_outputs(result: FitResult, doc: dict, out: Path, formats: tuple[str, ...] = ("png",)) -> list[str]:
    """Write all outputs (``doc`` is result.to_dict(); figures in ``formats``) to a staging folder beside ``out``,
    then swap it with ``out`` in one step: a reader (or a kill) sees the earlier outputs or these, never a mix.
    ``out`` is replaced as a whole."""
    from analysis.exports import latex, tidy
    from analysis.plots import make_plots  # matplotlib only when there is something to draw
    from analysis.report import build_blocks, render_html, render_markdown

    refuse_foreign_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out)
        staging = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(out)}{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise InputError(f"cannot write the outputs beside {out} ({e.strerror or e})") from None
    try:
        (staging / "fit.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        if result.thetas is not None:
            bootstrap_frame(result).to_csv(staging / "bootstrap.csv", index=False)
        images = make_plots(result, staging, result.config.workers, formats)
        tables = tidy(doc)
        tables.to_csv(staging / "tables.csv", index=False)
        (staging / "tables.tex").write_text(latex(tables))
        blocks = build_blocks(doc)
        (staging / "report.md").write_text(render_markdown(blocks))
        (staging / "report.html").write_text(render_html(blocks, images))
        names = sorted(p.name for p in staging.iterdir())
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the outputs from other users
        _HOLD.append(True)  # the swap and its record happen together
        try:
            if _SIGNALS:  # a signal whose KeyboardInterrupt was swallowed (see _interrupt): publish nothing
                raise KeyboardInterrupt(_SIGNALS[0])
            swap_folders(staging, out)
            _PUBLISHED.append(str(out))
        finally:
            _HOLD.clear()
        if _SIGNALS:  # one that came during the swap
            raise KeyboardInterrupt(_SIGNALS[0])
    except OSError as e:  # a full disk or quota: nothing published, the earlier outputs stay
        raise InputError(f"cannot write the outputs to {out} ({e.strerror or e}); earlier outputs in it are "
                         f"untouched") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # the earlier outputs, once swapped out
    return names


def summary_lines(doc: dict) -> list[str]:
    """What `analysis fit` prints: the runs, each approach's allocation exponent, the law, what the plan uses."""
    b = doc["data"]["budgets"]
    replicates = [g for g in doc["data"]["duplicates"] if g.get("replicates")]
    seeds = (f", {sum(len(g['run_ids']) for g in replicates)} of them seed replicates of {len(replicates)} "
             f"experiment(s): median loss range {np.median([g['loss_range'] for g in replicates]):.3g} nats"
             if replicates else "")
    lines = [f"fitted {doc['data']['n_runs']} runs ("
             + ("continuous C, no IsoFLOP budgets" if b["mode"] == "continuous" else f"{len(b['groups'])} budgets")
             + f"{seeds})"]
    for key in APPROACHES:
        section = doc[key]
        if section.get("skipped"):
            lines.append(f"{TITLES[key]}: skipped: {section['reason']}")
            continue
        a_ci = (section.get("ci") or {}).get("a")
        ident = section["identification"]
        state = ("identified" if ident["identified"] else
                 "NOT identified: by the design" if ident.get("by_design") else "NOT identified")
        extra = (f" {section['form']} form, L = {section['formula'][4:]}: "
                 + " ".join(f"{name}={section[name]:.4g}" for name in FORMS[section['form']].names)
                 if key == "approach3" else "")
        if key == "envelope":
            extra = (" from training curves (--envelope curves)" if section["points_from"] == "curves"
                     else " from final losses (end points only)")
        a = "-" if section["a"] is None else f"{section['a']:.4g}"
        lines.append(f"{TITLES[key]}: a={a}" + (f" [{a_ci[0]:.4g}, {a_ci[1]:.4g}]" if a_ci else "")
                     + f"{extra} ({state})")
    forms = doc["approach3"]["forms"]
    if forms:
        header, cells = forms_cells(forms)
        skipped = next(row["holdout_skipped"] for row in forms if not row["skipped"])
        lines.append("every form fitted (* the one used" + (f"; no hold-out errors: {skipped}" if skipped else "")
                     + "):")
        lines += ["  " + line for line in pd.DataFrame(cells, columns=header).to_string(index=False).splitlines()]
    if doc["law"]:
        lines.append(law_line(doc["law"]))
    comp = doc["comparison"]
    if comp["preferred"]:
        lines.append(f"plan uses {TITLES[comp['preferred']]}: {comp['why']}"
                     + disagreement_note(comp["preferred"], comp["disagreements"]))
    return lines


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SIGNALS: list[str] = []
_PUBLISHED: list[str] = []  # output folders this process has finished writing
# Non-empty while the outputs are swapped into place. A signal mask would not do: it is per thread, and with
# any other thread alive (a pool's, a library's) the process's signal is taken there and the handler runs.
_HOLD: list[bool] = []


def _interrupt(signum: int, frame: object) -> None:
    """Stop on SIGINT, SIGTERM or SIGHUP. The KeyboardInterrupt raised here is lost when the signal
    lands in code whose exceptions Python ignores (the at-fork hooks run while a process pool
    starts), so the signal is also recorded and checked before any output is published. During the
    swap (``_HOLD``) it is only recorded: ``write_outputs`` raises it after the swap."""
    _SIGNALS.append(signal.Signals(signum).name)
    if not _HOLD:
        raise KeyboardInterrupt(_SIGNALS[-1])


def _unraisable(info: sys.UnraisableHookArgs) -> None:
    if not (isinstance(info.exc_value, KeyboardInterrupt) and _SIGNALS):  # else: re-raised before publishing
        sys.__unraisablehook__(info)


@contextmanager
def stopping_on_signals() -> Iterator[list[str]]:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt inside (see ``_interrupt``); yields the output folders
    published so far."""
    _SIGNALS.clear()
    _PUBLISHED.clear()
    previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    try:
        yield _PUBLISHED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook
