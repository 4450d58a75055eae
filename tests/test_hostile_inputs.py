"""Every hostile input of the reviews (issues 32 and 48), in one table: each gives one ``error:`` line and a non-zero
exit, writes nothing outside the folder it was given and loses nothing in it (docs/bad-inputs.md lists them with
what the user sees). In-process, each on a copy of one finished tiny run or on a small file of its own."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from analysis.cli import main as analysis_main
from analysis.synthetic import isoflop_runs
from lab.commands.cli import export_main, run_main, sample_main
from lab.runtime import checkpoint
from lab.runtime.files import take_lock
from sweeps.cli import main as sweeps_main

DEEP = "x = " + "[" * 20_000 + "]" * 20_000 + "\n"
BINARY = b"\x80\x81\xfe\xff\x00PK\x03\x04 not text"


@pytest.fixture(scope="module")
def fit_doc(tmp_path_factory) -> dict:
    """A fit.json of the Kaplan-with-E form (its approach3 has alpha_N) on synthetic runs."""
    root = tmp_path_factory.mktemp("fit")
    isoflop_runs((1e17, 3e17, 1e18, 3e18), per_budget=9, spread=6, noise=0.005, seed=0).to_csv(root / "runs.csv",
                                                                                                 index=False)
    assert analysis_main(["fit", str(root / "runs.csv"), "--out", str(root / "fit"), "--form", "kaplan-e",
                          "--bootstrap", "0", "--no-progress"]) == 0
    return json.loads((root / "fit" / "fit.json").read_text())


SWEEP = """shapes = { aspect = 32, width_multiple = 64, head_dim = 64 }
rules = { lr = 2e-3, batch_tokens = 16384 }
base = { model = { block_size = 256 }, data = { vocab_size = 4096 } }
[sweep]
name = "hostile"
budgets = [1e13]
sizes = [3e5, 1e6]
"""


class Case:
    """One hostile input: ``make(tmp, run, ctx)`` builds it and returns (command, argv); ``message`` is in the line."""

    def __init__(self, make: Callable, message: str, needs_run: bool = False):
        self.make, self.message, self.needs_run = make, message, needs_run


def _finished_copy(ctx: dict, tmp: Path, without: tuple[str, ...] = ("summary.json",)) -> Path:
    run = tmp / "r"
    shutil.copytree(ctx["finished"], run)
    for name in without:
        (run / name).unlink()
    return run


def _completed_without_checkpoints(tmp, ctx):
    run = _finished_copy(ctx, tmp, without=())
    shutil.rmtree(run / "checkpoints")
    return run_main, [*ctx["args"], "--run-dir", str(run), "--resume", "auto"]


def _lock_link(tmp, ctx):
    (tmp / "r").mkdir()
    (tmp / "r" / ".lock").symlink_to(tmp / "precious.txt")
    return run_main, [*ctx["args"], "--run-dir", str(tmp / "r")]


def _locks_refused(tmp, ctx):
    def refused(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    ctx["monkeypatch"].setattr(fcntl, "flock", refused)
    return run_main, [*ctx["args"], "--run-dir", str(tmp / "r")]


def _config(text: str | bytes, *more: str) -> Callable:
    def make(tmp, ctx):
        (tmp / "c.toml").write_bytes(text if isinstance(text, bytes) else text.encode())
        return run_main, [*ctx["args"], "--config", str(tmp / "c.toml"), *more, "--run-dir", str(tmp / "r")]
    return make


def _option(*option: str) -> Callable:
    return lambda tmp, ctx: (run_main, [*ctx["args"], *option, "--run-dir", str(tmp / "r")])


def _run_dir_a_file(tmp, ctx):
    (tmp / "r").write_text("not a folder")
    return run_main, [*ctx["args"], "--run-dir", str(tmp / "r")]


def _in_use(tmp, ctx):
    run = _finished_copy(ctx, tmp)
    ctx["held"] = take_lock(run / ".lock")
    return run_main, [*ctx["args"], "--run-dir", str(run), "--resume", "auto"]


def _resume_changed(tmp, ctx):
    run = _finished_copy(ctx, tmp)
    return run_main, [*ctx["args"], "--run-dir", str(run), "--resume", "--model.d_model", "64"]


class _Payload:
    def __reduce__(self):
        return exec, ("raise SystemExit('the pickle ran')",)


def _crafted(edit: Callable[[Path], None], command: str) -> Callable:
    def make(tmp, ctx):
        run = _finished_copy(ctx, tmp)
        edit(run / "checkpoints" / "step-000008")
        if command == "resume":
            return run_main, [*ctx["args"], "--run-dir", str(run), "--resume"]
        return (export_main, [str(run)]) if command == "export" else (sample_main, [str(run), "--tokens", "2"])
    return make


def _link(name: str, target: str | None = None) -> Callable[[Path], None]:
    def edit(step: Path) -> None:
        outside = Path(target) if target else step.parents[3] / "outside"
        if not target:
            shutil.copy(step / name, outside)
        (step / name).unlink()
        (step / name).symlink_to(outside)
    return edit


def _escape(step: Path) -> None:
    metadata = checkpoint.read_dcp_metadata(step)
    for key, info in metadata.storage_data.items():
        metadata.storage_data[key] = type(info)(relative_path="../../../outside", offset=info.offset,
                                                length=info.length, transform_descriptors=None)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))


def _run_file(name: str, data: bytes, command: str) -> Callable:
    def make(tmp, ctx):
        run = _finished_copy(ctx, tmp)
        (run / name).write_bytes(data)
        return (export_main, [str(run)]) if command == "export" else (sample_main, [str(run), "--tokens", "2"])
    return make


def _sweep(text: str | bytes, *command: str, folder: bool = False) -> Callable:
    def make(tmp, ctx):
        (tmp / "s.toml").write_bytes(text if isinstance(text, bytes) else text.encode())
        return sweeps_main, [command[0], str(tmp / "s.toml"), *command[1:], *(["--folder", str(tmp / "sweep")]
                                                                              if folder else [])]
    return make


def _driver_lock_link(tmp, ctx):
    (tmp / "sweep").mkdir()
    (tmp / "sweep" / ".driver.lock").symlink_to(tmp / "precious.txt")
    return _sweep(SWEEP, "run", "--no-progress", folder=True)(tmp, ctx)


def _corrupt_registry(tmp, ctx):
    (tmp / "sweep").mkdir()
    (tmp / "sweep" / "sweep.db").write_bytes(b"this is not an SQLite database\n" * 100)
    return sweeps_main, ["status", str(tmp / "sweep")]


def _table(text: bytes) -> Callable:
    def make(tmp, ctx):
        (tmp / "runs.csv").write_bytes(text)
        return analysis_main, ["fit", str(tmp / "runs.csv"), "--out", str(tmp / "fit"), "--no-progress"]
    return make


def _sweep_summary_binary(tmp, ctx):
    run = tmp / "sweep" / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"tokens": 2048, "batch_tokens": 256}}))
    (run / "summary.json").write_bytes(BINARY)
    return analysis_main, ["fit", str(tmp / "sweep"), "--out", str(tmp / "fit"), "--no-progress"]


def _fit(edit: Callable[[dict], None], command: str) -> Callable:
    def make(tmp, ctx):
        doc = json.loads(json.dumps(ctx["fit_doc"]))
        edit(doc)
        (tmp / "fit").mkdir()
        (tmp / "fit" / "fit.json").write_text(json.dumps(doc))
        if command == "predict":
            return analysis_main, ["predict", str(tmp / "fit" / "fit.json"), "--params", "1e8", "--tokens", "2e9"]
        return analysis_main, ["plan", str(tmp / "fit" / "fit.json"), "--gpu", "h100", "--n-gpus", "8", "--mfu",
                               "0.4", "--flops", "1e21"]
    return make


CASES = {
    # issue 48
    "a completed run whose checkpoints were removed, --resume auto":
        Case(_completed_without_checkpoints, "is already complete (8 steps)", needs_run=True),
    "the run's .lock is a symbolic link": Case(_lock_link, ".lock is a symbolic link"),
    "a file system that refuses flock": Case(_locks_refused, "refuses locks (No locks available)"),
    "[model] preset = [1]": Case(_config("[model]\npreset = [1]\n"), "unknown model preset '[1]'"),
    "a config nested 20,000 deep": Case(_config(DEEP), "invalid TOML (nested too deeply)"),
    "a checkpoint's .metadata links to /dev/zero":
        Case(_crafted(_link(".metadata", "/dev/zero"), "resume"), "its .metadata is not a plain file", True),
    "a storage entry names ../../../outside":
        Case(_crafted(_escape, "export"), "names the data file '../../../outside'", True),
    "a checkpoint's meta.json links outside":
        Case(_crafted(_link(checkpoint.META), "sample"), "its meta.json is a symbolic link", True),
    "a data file of a checkpoint links outside":
        Case(_crafted(_link("__0_0.distcp"), "export"), "its data file __0_0.distcp is not a plain file", True),
    "config.json is [] (sample)": Case(_run_file("config.json", b"[]", "sample"), "is not a run's config", True),
    "sweep per_budget = 1_000_000_000": Case(_sweep(SWEEP.replace(
        "sizes = [3e5, 1e6]", 'centre = { prior = "tokens_per_param", tokens_per_param = 20 }\n'
                              "per_budget = 1_000_000_000"), "plan"), "[sweep] per_budget must be at most 100"),
    "sweep budgets = [1e300]": Case(_sweep(SWEEP.replace("[1e13]", "[1e300]"), "plan"),
                                    "[sweep] budgets[0] is 1e+300 FLOPs"),
    "a sweep file nested 20,000 deep": Case(_sweep(DEEP + SWEEP, "plan"), "invalid TOML (nested too deeply)"),
    "the sweep's .driver.lock is a symbolic link": Case(_driver_lock_link, ".driver.lock is a symbolic link"),
    "a CSV with a header and no rows (fit)": Case(_table(b"params,tokens,flops,loss\n"), "need at least 5 runs"),
    "fit.json approach3.alpha_N missing (predict)":
        Case(_fit(lambda d: d["approach3"].pop("alpha_N"), "predict"), "approach3.alpha_N is missing or null"),
    "fit.json approach3.alpha_N null (predict)":
        Case(_fit(lambda d: d["approach3"].update(alpha_N=None), "predict"), "approach3.alpha_N is missing or null"),
    # issue 32 and before
    "model = 3 in a config": Case(_config("model = 3\n"), "'model' must be a table ([model]), got 3"),
    "a config that is not UTF-8": Case(_config(b"\xff\xfe[train]\n"), "is not UTF-8 text (byte 0)"),
    "--train.lr nan": Case(_option("--train.lr", "nan"), "train.lr: expected a finite float, got 'nan'"),
    "[train] beta2 = inf": Case(_config("[train]\nbeta2 = inf\n"), "train.beta2: expected a finite float, got inf"),
    "--run-dir is a file": Case(_run_dir_a_file, "is a file, not a folder"),
    "a second launch on a run in use": Case(_in_use, "is in use by another run", True),
    "--resume with another model": Case(_resume_changed, "--resume cannot change model.d_model", True),
    "a checkpoint's .metadata pickles a call":
        Case(_crafted(lambda step: (step / ".metadata").write_bytes(pickle.dumps(_Payload())), "resume"),
             "its .metadata asks for builtins.exec, which is not a type DCP writes", True),
    "a checkpoint's meta.json truncated":
        Case(_crafted(lambda step: (step / checkpoint.META).write_bytes(b'{"step": 8, "form'), "export"),
             "is unreadable (meta.json", True),
    "config.json binary (export)": Case(_run_file("config.json", BINARY, "export"), "not UTF-8 text", True),
    "a sweep name with a newline": Case(_sweep(SWEEP.replace('"hostile"', '"a\\nb"'), "plan"),
                                        "no control characters"),
    "a sweep file that is not UTF-8": Case(_sweep(b"[sweep]\nname = \"\xff\"\n", "plan"), "is not UTF-8 text"),
    "a SLURM partition that injects a line":
        Case(_sweep(SWEEP + '[slurm]\npartition = "gpu\\n#SBATCH --uid=0"\n', "plan"),
             "holds characters SLURM would not read as written"),
    "a corrupt sweep.db (status)": Case(_corrupt_registry, "is not a readable sweep registry"),
    "a binary runs.csv (fit)": Case(_table(b"\xff\xfe\x00\x01binary"), "cannot read"),
    "a binary summary.json in a sweep folder (fit)": Case(_sweep_summary_binary, "not UTF-8 text"),
    "fit.json with a string for a number (plan)":
        Case(_fit(lambda d: d["approach3"].update(a="abc"), "plan"),
             "approach3.a must be a finite number or null, got 'abc'"),
}


def _state(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) and a digest of what it holds."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path)] = f"link to {path.readlink()}"
        elif path.is_file():
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[str(path)] = "folder"
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if c.needs_run else n
                                  for n, c in CASES.items()])
def test_a_hostile_input_gets_one_line_and_a_non_zero_exit_and_writes_nothing(name, request, args, fit_doc, tmp_path,
                                                                             capsys, monkeypatch):
    case = CASES[name]
    (tmp_path / "precious.txt").write_text("keep me\n")
    ctx = {"args": args, "fit_doc": fit_doc, "monkeypatch": monkeypatch,
           "finished": request.getfixturevalue("finished_run") if case.needs_run else None}
    main, argv = case.make(tmp_path, ctx)
    before = _state(tmp_path)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    finally:
        if "held" in ctx:
            ctx["held"].close()
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code not in (0, None) and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert case.message in lines[0], lines[0]
    after = _state(tmp_path)
    lost = {p: d for p, d in before.items() if after.get(p) != d}
    added = sorted(set(after) - set(before) - {str(tmp_path / "r"), str(tmp_path / "r" / ".lock")})  # lock taken
    assert lost == {} and added == [], (lost, added)
    assert (tmp_path / "precious.txt").read_text() == "keep me\n"


@pytest.mark.slow
def test_a_metrics_line_with_a_step_that_is_not_a_whole_number_is_dropped_on_resume(args, finished_run, tmp_path):
    run = _finished_copy({"finished": finished_run}, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-000008")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": "x"}\n{"step": true, "loss": 1}\n')
    assert run_main([*args, "--run-dir", str(run), "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(line)["step"] for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
