"""Every hostile input of the reviews (issues 32, 48 and 59), in one table: each gives one ``error:`` line and a non-zero
exit, writes nothing outside the folder it was given and loses nothing in it (docs/bad-inputs.md lists them with
what the user sees). In-process, each on a copy of one finished tiny run or on a small file of its own."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from analysis.cli import main as analysis_main
from analysis.synthetic import isoflop_runs
from lab.commands.cli import export_main, run_main, sample_main
from lab.commands.hf import import_main
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


# ---------------------------------------------------------------- issue 59


def _run_dir_with(name: str, make_file: Callable[[Path, Path], None], *more: str) -> Callable:
    """A run folder of the lab's (its lock) holding ``name`` as ``make_file(path, tmp)`` leaves it."""
    def make(tmp, ctx):
        (tmp / "r").mkdir()
        (tmp / "r" / ".lock").touch()
        make_file(tmp / "r" / name, tmp)
        return run_main, [*ctx["args"], "--run-dir", str(tmp / "r"), *more]
    return make


def _user_config_in_run_dir(tmp, ctx):
    (tmp / "r").mkdir()
    (tmp / "r" / "config.json").write_text('{"mine": true}\n')
    return run_main, [*ctx["args"], "--run-dir", str(tmp / "r")]


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LAB_AGENT_PID")


def _environment(**variables: str) -> Callable:
    """A run under exactly these rank variables: the others unset (an earlier test in this process may have set one:
    DeepSpeed's world of one sets WORLD_SIZE)."""
    def make(tmp, ctx):
        for name in RANK_VARIABLES:
            ctx["monkeypatch"].delenv(name, raising=False)
        for name, value in variables.items():
            ctx["monkeypatch"].setenv(name, value)
        return run_main, [*ctx["args"], "--run-dir", str(tmp / "r")]
    return make


def _fit_into_a_sweep(tmp, ctx):
    sweep = tmp / "sweep"
    (sweep / "runs" / "a").mkdir(parents=True)
    (sweep / "sweep.db").write_bytes(b"the registry")
    (sweep / "notes.txt").write_text("mine\n")
    return analysis_main, ["fit", str(sweep), "--out", str(sweep), "--no-progress"]


def _sweep_into_a_folder_of_mine(tmp, ctx):
    (tmp / "sweep").mkdir()
    (tmp / "sweep" / "sweep.toml").write_text("# my own sweep file\n")
    return _sweep(SWEEP, "run", "--no-progress", folder=True)(tmp, ctx)


def _sweep_folder(folder: str) -> Callable:
    def make(tmp, ctx):
        (tmp / "s.toml").write_text(SWEEP)
        return sweeps_main, ["plan", str(tmp / "s.toml"), "--folder", str(tmp / folder)]
    return make


def _sweep_folder_a_file(tmp, ctx):
    (tmp / "sweep").write_text("not a folder")
    return _sweep(SWEEP, "run", "--no-progress", folder=True)(tmp, ctx)


def _run_config(tree: dict) -> Callable:
    def make(tmp, ctx):
        (tmp / "r").mkdir()
        (tmp / "r" / "config.json").write_text(json.dumps(tree))
        return export_main, [str(tmp / "r")]
    return make


def _jsonl_table(text: str) -> Callable:
    def make(tmp, ctx):
        (tmp / "runs.jsonl").write_text(text)
        return analysis_main, ["fit", str(tmp / "runs.jsonl"), "--out", str(tmp / "fit"), "--no-progress"]
    return make


def _csv_rows(edit: Callable[[list[str]], list[str]]) -> Callable:
    def make(tmp, ctx):
        isoflop_runs((1e17, 3e17, 1e18), per_budget=7, spread=6, noise=0.005, seed=0).to_csv(tmp / "t.csv",
                                                                                            index=False)
        lines = (tmp / "t.csv").read_text().splitlines()
        (tmp / "t.csv").unlink()
        (tmp / "runs.csv").write_text("\n".join(edit(lines)) + "\n")
        return analysis_main, ["fit", str(tmp / "runs.csv"), "--out", str(tmp / "fit"), "--no-progress"]
    return make


def _huge_params(lines: list[str]) -> list[str]:
    header = lines[0].split(",")
    cells = lines[1].split(",")
    cells[header.index("params")] = "1e308"
    return [lines[0], ",".join(cells), *lines[2:]]


TINY_HF = {"model_type": "gpt2", "vocab_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8, "n_positions": 8}


def _hf_folder(config: object, **files: object) -> Callable:
    def make(tmp, ctx):
        folder = tmp / "hf"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        for name, content in files.items():
            name = name.replace("_", ".")
            if content == "fifo":
                os.mkfifo(folder / name)
            else:
                (folder / name).write_text(json.dumps(content))
        return import_main, [str(folder), "--run-dir", str(tmp / "r")]
    return make


def _export_hf_into(tmp, ctx):
    run = _finished_copy(ctx, tmp)
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("years of work\n")
    return export_main, [str(run), "--format", "hf", "--out", str(tmp / "mine")]


def _export_pt_onto_a_folder(tmp, ctx):
    run = _finished_copy(ctx, tmp)
    (tmp / "mine").mkdir()
    (tmp / "mine" / "keep.txt").write_text("keep\n")
    return export_main, [str(run), "--out", str(tmp / "mine")]


def _meta_step(step: Path) -> None:
    meta = json.loads((step / checkpoint.META).read_text())
    (step / checkpoint.META).write_text(json.dumps({**meta, "step": 10**12}))


def _fifo(path: Path, tmp: Path) -> None:
    os.mkfifo(path)


def _link_outside(path: Path, tmp: Path) -> None:
    path.symlink_to(tmp / "precious.txt")


LONG = "x" * 300


CASES = {
    # issue 59
    "analysis fit SWEEP --out SWEEP (the sweep's own folder)":
        Case(_fit_into_a_sweep, "holds files the lab did not write"),
    "a user's config.json in --run-dir": Case(_user_config_in_run_dir, "holds files the lab did not write"),
    "a user's sweep.toml in --folder (sweeps run)":
        Case(_sweep_into_a_folder_of_mine, "holds files the lab did not write"),
    "attempts.jsonl links outside the run": Case(_run_dir_with("attempts.jsonl", _link_outside), "is not a plain file"),
    "metrics.jsonl is a FIFO, --resume auto":
        Case(_run_dir_with("metrics.jsonl", _fifo, "--resume", "auto"), "is not a plain file"),
    "[sweep] folder with a newline": Case(_sweep(SWEEP.replace('budgets', 'folder = "a\\n#SBATCH --uid=0"\nbudgets'),
                                                  "plan"), "holds the control character"),
    "--folder with a newline": Case(_sweep_folder("a\nsrun evil"), "--folder"),
    "a sweep name with U+2028": Case(_sweep(SWEEP.replace('"hostile"', '"a\u2028error: forged"'), "plan"),
                                     "no control characters"),
    "a sweep name with a C1 control (NEL)": Case(_sweep(SWEEP.replace('"hostile"', '"a\\u0085b"'), "plan"),
                                                  "no control characters"),
    "--folder that is a file (sweeps run)": Case(_sweep_folder_a_file, "is a file, not a folder"),
    "--folder of a 300-character name": Case(_sweep_folder(LONG), "is too long"),
    "--run-dir of a 300-character name": Case(lambda tmp, ctx: (run_main, [*ctx["args"], "--run-dir",
                                                                           str(tmp / LONG)]), "is too long"),
    "train.micro_batch of 40 digits (found by the fuzz test: hung)":
        Case(_option("--train.micro_batch", "9" * 40), "is not a multiple of train.micro_batch"),
    "RANK=1 without WORLD_SIZE": Case(_environment(RANK="1"), "RANK=1 is set without WORLD_SIZE"),
    "RANK=abc": Case(_environment(RANK="abc", WORLD_SIZE="2"), "RANK='abc' must be a whole number"),
    "LOCAL_RANK=abc (the error line itself was a traceback)":
        Case(_environment(LOCAL_RANK="abc"), "LOCAL_RANK='abc' must be a whole number"),
    "a stale LAB_AGENT_PID": Case(_environment(TORCHELASTIC_RUN_ID="x", LAB_AGENT_PID="999999999"),
                                  "is not this rank's parent"),
    "config.json with n_layer = 100000000 (export)": Case(_run_config({"model": {"n_layer": 100_000_000}}),
                                                          "model.n_layer must be at most"),
    "a JSONL table line nested 200,000 deep": Case(_jsonl_table('{"params": ' + "[" * 200_000 + "]" * 200_000
                                                                + "}\n"), "nested too deeply"),
    "a run_id with U+2028 in a table (found by the fuzz test: forged a line)":
        Case(_csv_rows(lambda lines: [line.replace("run0003", "run\u2028error: forged") for line in lines]),
             "holds the control character '\\u2028'"),
    "params = 1e308 in a table": Case(_csv_rows(_huge_params), "column 'params' has 1 value(s) above 1e+40"),
    "an HF config.json that is a list": Case(_hf_folder([1, 2]), "is not a model's config"),
    "an HF config.json without vocab_size":
        Case(_hf_folder({k: v for k, v in TINY_HF.items() if k != "vocab_size"}), "no vocab_size"),
    'an HF config.json with n_layer "3"': Case(_hf_folder({**TINY_HF, "n_layer": "3"}),
                                               'n_layer = "3" must be a positive whole number'),
    "an HF index whose weight_map names ../outside":
        Case(_hf_folder(TINY_HF, model_safetensors_index_json={"weight_map": {"a": "../outside.safetensors"}}),
             "weight_map names the file '../outside.safetensors'"),
    "an HF index whose weight_map names an absolute path":
        Case(_hf_folder(TINY_HF, model_safetensors_index_json={"weight_map": {"a": "/etc/passwd"}}),
             "weight_map names the file '/etc/passwd'"),
    "an HF tokenizer.json that is a FIFO": Case(_hf_folder(TINY_HF, tokenizer_json="fifo"), "not a plain file"),
    "lab export --format hf --out a folder of the user's":
        Case(_export_hf_into, "holds files the lab did not write (thesis.tex)", needs_run=True),
    "lab export --out an existing folder (pt)": Case(_export_pt_onto_a_folder, "is a folder or a link", True),
    "a checkpoint's meta.json with step 1e12": Case(_crafted(_meta_step, "export"), "is not one of a run", True),
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


@pytest.mark.slow
def test_resume_keeps_folders_under_checkpoints_that_are_not_the_labs(args, finished_run, tmp_path):
    run = _finished_copy({"finished": finished_run}, tmp_path)
    for name in ("best", "step-000001-backup"):
        shutil.copytree(run / "checkpoints" / "step-000004", run / "checkpoints" / name)
    (run / "checkpoints" / "step-000006.tmp").mkdir()  # the lab's own leftover: removed
    (run / ".my-notes.tmp").write_text("mine\n")
    assert run_main([*args, "--run-dir", str(run), "--resume"]) == 0
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["best", "step-000001-backup", "step-000004", "step-000008"]
    assert (run / ".my-notes.tmp").read_text() == "mine\n"


def test_appends_never_follow_a_link_nor_block_on_a_fifo(tmp_path):
    from lab.runtime.files import append_line, open_append

    (tmp_path / "outside.jsonl").write_text("keep\n")
    (tmp_path / "attempts.jsonl").symlink_to(tmp_path / "outside.jsonl")
    os.mkfifo(tmp_path / "metrics.jsonl")
    for name in ("attempts.jsonl", "metrics.jsonl"):
        with pytest.raises(OSError):
            append_line(tmp_path / name, "{}")
        with pytest.raises(OSError):
            open_append(tmp_path / name)
    assert (tmp_path / "outside.jsonl").read_text() == "keep\n"


def test_records_are_read_bounded_without_following_a_link_or_blocking_on_a_fifo(tmp_path):
    from lab.runtime.files import read_lines

    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "big.jsonl").write_text('{"step": 1}\n' * 100)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "big.jsonl")
    for path, limit in ((tmp_path / "fifo.jsonl", 10**6), (tmp_path / "link.jsonl", 10**6),
                        (tmp_path / "big.jsonl", 100)):
        with pytest.raises(OSError):
            read_lines(path, limit)
    assert len(read_lines(tmp_path / "big.jsonl")) == 100


def _full_disk(monkeypatch) -> None:
    """Every Path.write_text and write_bytes fails as on a full disk."""
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    monkeypatch.setattr(Path, "write_bytes", full)


def test_a_full_disk_during_analysis_fit_is_one_line_and_keeps_the_earlier_outputs(tmp_path, capsys, monkeypatch):
    isoflop_runs((1e17, 3e17, 1e18), per_budget=7, spread=6, noise=0.005, seed=0).to_csv(tmp_path / "runs.csv",
                                                                                        index=False)
    (tmp_path / "fit").mkdir()
    (tmp_path / "fit" / "fit.json").write_text("{}\n")  # an earlier fit's
    _full_disk(monkeypatch)
    code = analysis_main(["fit", str(tmp_path / "runs.csv"), "--out", str(tmp_path / "fit"), "--bootstrap", "0",
                          "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    monkeypatch.undo()
    assert (tmp_path / "fit" / "fit.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fit", "runs.csv"]  # no staging folder left


def test_a_full_disk_during_sweeps_run_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "s.toml").write_text(SWEEP)
    _full_disk(monkeypatch)
    code = sweeps_main(["run", str(tmp_path / "s.toml"), "--folder", str(tmp_path / "sweep"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0], err


@pytest.mark.slow
def test_an_hf_export_replaces_only_its_own_folder_and_an_import_waits_for_no_run(args, finished_run, tmp_path,
                                                                                  capsys):
    run, out = _finished_copy({"finished": finished_run}, tmp_path), tmp_path / "hf"
    for _ in range(2):  # the second replaces the first, which holds its marker
        assert export_main([str(run), "--format", "hf", "--out", str(out)]) == 0
    assert (out / ".lab-export").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "r"]  # no temporary folder left
    (tmp_path / "imported").mkdir()
    held = take_lock(tmp_path / "imported" / ".lock")  # a run training there
    try:
        assert import_main([str(out), "--run-dir", str(tmp_path / "imported"), *args[args.index("--data.corpus"):]]) \
            == 2
    finally:
        held.close()
    assert "is in use by another run" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "imported").iterdir()) == [".lock"]  # nothing written meanwhile


def test_a_line_nested_too_deeply_is_an_unreadable_line_for_every_reader(tmp_path):
    from lab.runtime.files import loads_line
    from sweeps.progress import last_step

    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        loads_line(deep)
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n' + deep[:8000] + deep[-8000:] + "\n")
    assert last_step(tmp_path) == 3


def test_lab_plot_reads_metrics_bounded_and_never_through_a_link(tmp_path):
    from lab.commands.plot import read_curves
    from lab.runtime.config import ConfigError

    (tmp_path / "outside.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").symlink_to(tmp_path / "outside.jsonl")
    with pytest.raises(ConfigError, match="cannot be read"):
        read_curves(tmp_path / "r")


def test_a_runs_eval_json_is_read_bounded_never_through_a_link_nor_blocking_on_a_fifo(tmp_path):
    """``sweeps export`` and ``analysis`` read a run's task scores (eval.json) as they read its summary: a FIFO or a
    link there gives no columns instead of blocking or reading elsewhere; ``lab eval`` refuses it in one line before
    any work."""
    from lab.commands.harness import previous_scores
    from lab.runtime.config import ConfigError
    from lab.runtime.scores import SCORES, task_columns

    scores = {"tasks": {"hellaswag": {"step": 4, "metrics": {"acc": 0.25}}}}
    (tmp_path / "elsewhere.json").write_text(json.dumps(scores))
    for kind in ("link", "fifo", "list"):
        run = tmp_path / kind
        run.mkdir()
        if kind == "link":
            (run / SCORES).symlink_to(tmp_path / "elsewhere.json")
        elif kind == "fifo":
            os.mkfifo(run / SCORES)
        else:
            (run / SCORES).write_text("[1, 2]")
        assert task_columns(run) == {}, kind
        with pytest.raises(ConfigError, match="move it aside") as e:
            previous_scores(run / SCORES)
        assert "\n" not in str(e.value)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / SCORES).write_text(json.dumps(scores))
    assert task_columns(tmp_path / "plain") == {"task_hellaswag": 0.25}
    assert previous_scores(tmp_path / "plain" / SCORES) == scores["tasks"]


def test_a_table_appended_to_itself_exports_to_latex_with_each_row_once_named(fit_doc):
    """The same rows twice (a table appended to itself) give a LaTeX table whose repeated rows are named apart
    ("id (2)"), not a traceback from pivoting duplicate entries."""
    import pandas as pd

    from analysis.exports import latex, tidy

    frame = tidy(fit_doc)
    text = latex(pd.concat([frame, frame], ignore_index=True))
    rows = frame.drop_duplicates(["table", "row"])
    assert text.count(" (2) &") == len(rows) > 0  # each row of each table a second time, named apart
    assert f"{rows['row'].iloc[0]} (2) &" in text
