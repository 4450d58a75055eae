"""A run a newcomer cannot break: one test (or more) per problem a new user ran into.

Each names the problem it guards against; each failed on the code before the fix.
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.runtime import checkpoint
from lab.measure import device
from lab.commands.cli import run_main, sample_main

ROOT = Path(__file__).resolve().parents[1]


def run(run_dir: Path, *argv: str) -> int:
    return run_main([*argv, "--run-dir", str(run_dir)])


def records(run_dir: Path) -> list[dict]:
    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir) if "loss" in r]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------- 1. a second run without --run-dir


@pytest.mark.slow
def test_runs_without_run_dir_each_get_their_own_folder(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_main([*args, "--train.tokens", "512"]) == 0
    assert run_main([*args, "--train.tokens", "512"]) == 0
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all((f / "summary.json").is_file() for f in folders)
    assert f"run directory: runs/{folders[1].name}" in capsys.readouterr().out


# ---------------------------------------------------------------- 2. the CPU peak: fast, cached, no RNG


@pytest.mark.slow
def test_the_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    """(Its time budget is the next test's: a wall-clock bound here would fail on a busy machine.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(device.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: its figure is cached
    first = device.cpu_peak_flops(torch.bfloat16)
    assert first.flops > 0
    assert (tmp_path / "scaling-lab" / "cpu-peaks.json").is_file()
    monkeypatch.setattr(device, "measure_matmul_peak", lambda *a: pytest.fail("measured again"))
    assert device.cpu_peak_flops(torch.bfloat16) == first
    assert first.source.endswith(f"; cached in {tmp_path / 'scaling-lab' / 'cpu-peaks.json'})")


def test_a_slow_cpu_stops_growing_the_matmul_within_the_budget(monkeypatch):
    clock = {"now": 0.0}

    def slow_matmul(fn):  # as if each 256³ matmul took 0.2 s
        clock["now"] += 0.2
        return 0.2

    monkeypatch.setattr(device, "_timed", slow_matmul)
    monkeypatch.setattr(device.time, "perf_counter", lambda: clock["now"])
    assert device.measure_matmul_peak(torch.bfloat16, budget_s=1.5) == pytest.approx(2 * 256**3 / 0.2)
    assert clock["now"] <= 1.5  # one size only (the next would need 8 × 0.2 s × 4 runs), repeated within budget


def test_a_later_quieter_measurement_replaces_a_low_cached_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = iter([1e9, 5e9, 2e9])  # slow, fast, slow again (as if other work took the cores)
    monkeypatch.setattr(device, "measure_matmul_peak", lambda *a: next(figures))
    monkeypatch.setattr(device.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # every one cacheable, whatever runs here
    assert device.cpu_peak_flops(torch.float32).flops == 1e9
    assert device.remeasure_cpu_peak(torch.float32) == 5e9
    assert device.remeasure_cpu_peak(torch.float32) == 5e9  # the best figure stays
    assert device.cpu_peak_flops(torch.float32).flops == 5e9


@pytest.mark.slow
def test_measuring_the_peak_leaves_the_training_rng_alone(args, tmp_path, monkeypatch):
    state = torch.get_rng_state()
    device.measure_matmul_peak(torch.float32, budget_s=0.2)
    assert torch.equal(state, torch.get_rng_state())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh-cache"))  # forces a measurement
    dropout = ["--model.dropout", "0.1", "--train.tokens", "768"]
    assert run(tmp_path / "measured", *args, *dropout) == 0
    assert run(tmp_path / "given", *args, *dropout, "--train.peak_flops", "1e12") == 0
    assert losses(tmp_path / "measured") == losses(tmp_path / "given")
    assert json.loads((tmp_path / "measured" / "summary.json").read_text())["peak_flops_source"].startswith(
        "measured matmul peak")


@pytest.mark.slow
def test_an_impossible_mfu_says_the_peak_is_wrong_once(args, tmp_path, capsys):
    assert run(tmp_path / "r", *args, "--train.peak_flops", "1e6") == 0  # far below what the CPU does
    out = capsys.readouterr().out
    assert out.count("warning: MFU above 100%: the peak (1e+06 FLOP/s, train.peak_flops) reads low") == 1


# ---------------------------------------------------------------- 3. unknown and abbreviated options


@pytest.mark.parametrize("option, message", [
    ("--train.tok", "error: unknown option --train.tok (did you mean --train.tokens?)"),
    ("--modle.d_model", "error: unknown option --modle.d_model (did you mean --model.d_model?)"),
])
def test_unknown_or_abbreviated_options_get_one_line(option, message, tmp_path, capsys):
    # launch/run.py is run_main and sys.exit; the launch script itself is under test in test_train
    with pytest.raises(SystemExit) as exit_:
        run_main([option, "5", "--run-dir", str(tmp_path / "r")])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert one_error_line(err).startswith(message)
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- 4. run directory and cache folder


def test_a_run_dir_that_is_a_file_is_refused_before_any_work(args, tmp_path, capsys):
    (tmp_path / "taken").write_text("not a folder")
    assert run(tmp_path / "taken", *args) == 2
    assert "--run-dir" in one_error_line(capsys.readouterr().err) and (tmp_path / "taken").read_text() == "not a folder"


def test_an_unwritable_cache_dir_is_refused_before_any_work(args, tmp_path, capsys):
    assert run(tmp_path / "r", *args, "--data.cache_dir", "/proc/lab-cache", "--data.vocab_size", "600") == 2
    assert "data.cache_dir /proc/lab-cache is not writable" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- 5. corrupt checkpoints, wrong paths


@pytest.mark.slow
def test_a_corrupt_checkpoint_file_or_meta_gives_one_line(args, tmp_path, capsys):
    r = tmp_path / "r"
    assert run(r, *args, "--train.stop_after", "4") == 0
    last = checkpoint.latest(r)
    part = next(last.glob("*.distcp"))
    part.write_bytes(part.read_bytes()[:100])  # truncated
    assert run(r, *args, "--resume") == 2
    assert f"checkpoint {last} is unreadable" in one_error_line(capsys.readouterr().err)
    (last / "meta.json").write_text("{not json")
    assert run(r, *args, "--resume") == 2
    assert f"checkpoint {last} is unreadable" in one_error_line(capsys.readouterr().err)
    assert sample_main(["--run-dir", str(r)]) == 2
    assert "is unreadable" in one_error_line(capsys.readouterr().err)


@pytest.mark.slow
def test_sample_names_the_checkpoint_it_was_given(args, tmp_path, capsys):
    r = tmp_path / "r"
    assert run(r, *args, "--train.tokens", "512") == 0
    capsys.readouterr()
    assert sample_main(["--run-dir", str(r), "--checkpoint", "/nope"]) == 2
    assert one_error_line(capsys.readouterr().err) == "error: /nope is not a checkpoint (no meta.json)"


# ---------------------------------------------------------------- 6. impossible budgets and shapes


def test_a_budget_that_would_run_for_ages_is_refused(args, tmp_path, capsys):
    assert run(tmp_path / "r", *args, "--train.tokens", "1e30") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "train.tokens 1e+30" in line and "years" in line and "limit is 365 days" in line
    assert not (tmp_path / "r").exists()


def test_a_context_that_cannot_fit_in_memory_is_refused(args, tmp_path, capsys):
    assert run(tmp_path / "r", *args, "--model.block_size", "1000000", "--train.batch_tokens", "4000000") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "GiB per process" in line and "is available" in line
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- 8. interrupts


def _interrupt(run_dir: Path, argv: list[str], sig: int) -> tuple[int, str, str]:
    """Start a run, send ``sig`` once it has logged two steps, and wait for it to end."""
    proc = subprocess.Popen([sys.executable, "launch/run.py", *argv, "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step     2/"):
            proc.send_signal(sig)
            break
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(out) + rest, err


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_saves_a_checkpoint_and_says_how_to_resume(args, tmp_path, sig, code):
    long = [*args, "--train.tokens", "2560", "--train.checkpoint_every", "0"]  # 10 steps, no periodic saves
    r = tmp_path / "r"
    returncode, out, err = _interrupt(r, long, sig)
    assert returncode == code, err
    assert "Traceback" not in err
    summary = json.loads((r / "summary.json").read_text())
    name = signal.Signals(sig).name
    assert summary["status"] == "interrupted" and summary["signal"] == name and summary["steps"] < 10
    assert f"interrupted by {name} after step {summary['steps']} of 10; checkpoint saved; resume with" in out
    assert checkpoint.latest(r).name == f"step-{summary['steps']:06d}"
    if sig == signal.SIGINT:  # the resumed run ends where an uninterrupted one does
        assert run(r, *long, "--resume") == 0
        assert run(tmp_path / "full", *long) == 0
        assert losses(r) == losses(tmp_path / "full")


# ---------------------------------------------------------------- 9. non-finite gradients


@pytest.mark.slow
def test_a_non_finite_gradient_skips_the_step_and_keeps_the_files_strict(args, tmp_path, infinite_gradient_at_step_3):
    r = tmp_path / "r"
    assert run(r, *args, "--train.checkpoint_every", "2") == 0
    recs = records(r)  # strict JSON: no NaN or Infinity tokens
    skipped = [x for x in recs if "loss" in x and x["grad_norm"] is None]
    assert [x["step"] for x in skipped] == [3] and skipped[0]["skipped_steps"] == 1
    summary = json.loads((r / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1
    state = checkpoint.load_everything(checkpoint.latest(r))
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.slow
def test_a_non_finite_gradient_can_stop_the_run_instead(args, tmp_path, capsys, infinite_gradient_at_step_3):
    r = tmp_path / "r"
    assert run(r, *args, "--train.checkpoint_every", "2", "--train.nonfinite", "stop") == 1
    line = one_error_line(capsys.readouterr().err)
    assert "gradient norm is" in line and "step 3" in line and "step-000002" in line
    assert json.loads((r / "summary.json").read_text())["status"] == "diverged"
    assert [p.name for p in checkpoint.checkpoint_dirs(r)] == ["step-000002"]


# ---------------------------------------------------------------- 10. replacing a checkpoint


def test_replacing_a_checkpoint_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    r = tmp_path / "r"
    checkpoint.save(r, 4, 0, 1, {"model/w": torch.ones(2)}, {"wall_time_s": 1.0}, keep=2)
    real_replace = Path.replace

    def dying_rename(self, target):
        if self.name.endswith(".tmp") and not str(self).endswith(".json.tmp"):
            raise OSError("killed during the rename")
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", dying_rename)
    with pytest.raises(OSError):
        checkpoint.save(r, 4, 0, 1, {"model/w": torch.zeros(2)}, {"wall_time_s": 2.0}, keep=2)
    monkeypatch.undo()
    folder = checkpoint.latest(r)  # the earlier step-4, moved aside but still found
    assert folder is not None and checkpoint.read_meta(folder)["wall_time_s"] == 1.0
    assert torch.equal(checkpoint.load_everything(folder)["model/w"], torch.ones(2))
    checkpoint.clean_stale_temporaries(r)  # never deletes the only copy
    assert checkpoint.latest(r) == folder


# ---------------------------------------------------------------- 12. progress, ETA, leftovers


@pytest.mark.slow
def test_training_prints_an_estimate_and_an_eta(args, tmp_path, capsys):
    assert run(tmp_path / "r", *args) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "at 30% MFU" in first and first.split("| about ")[1].split()[0][-1] in "sn"  # e.g. "about 0s"
    steps = [line for line in out.splitlines() if line.startswith("step") and "| loss " in line]
    assert len(steps) == 8 and all("| eta " in line for line in steps)


@pytest.mark.slow
def test_leftovers_of_an_interrupted_run_are_cleaned_up(args, tmp_path):
    r = tmp_path / "r"
    assert run(r, *args, "--train.stop_after", "4") == 0
    (r / "checkpoints" / "step-000006.tmp").mkdir()
    (r / ".metrics.jsonl.tmp").write_text("half")
    (r / ".summary.json.abc123.tmp").write_text("half")
    assert run(r, *args, "--resume") == 0
    assert not list(r.glob(".*.tmp")) and not list((r / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_abandoned_data_preparation_folders_are_removed(tiny_data_config, tmp_path):
    from dataclasses import replace

    from lab.data import prepare
    cfg = replace(tiny_data_config, cache_dir=str(tmp_path / "cache"), vocab_size=520)
    folder = prepare(cfg, progress=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import shutil
    import socket
    shutil.rmtree(folder)
    stale = folder.parent / f".{folder.name}.{socket.gethostname()}-{dead.stdout.strip()}.abc.tmp"
    stale.mkdir()
    prepare(cfg, progress=False)
    assert not stale.exists() and folder.is_dir()


# ---------------------------------------------------------------- 13. layering


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function, in every form: ``import a.b``, ``from a
    import b`` (``a``, and ``a.b`` where that is a module), ``from a.b import c`` and relative imports (resolved
    against the package ``path`` lies in)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]  # an __init__.py's package is its folder
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else ())
            base = ".".join(p for p in (base, node.module or "") if p)
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_import_reader_sees_every_form(tmp_path, monkeypatch):
    """``_imports`` resolves each form of import the layering test must catch."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "lab" / "measure" / "deep").mkdir(parents=True)
    for folder in ("lab", "lab/measure", "lab/measure/deep", "lab/parallel"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "lab" / "parallel" / "mesh.py").write_text("")
    module = tmp_path / "lab" / "measure" / "deep" / "m.py"
    module.write_text("import lab.parallel.mesh\nfrom lab import parallel\nfrom lab.parallel.mesh import x\n"
                      "from ... import parallel as p\nfrom ...parallel import mesh\n"
                      "def f():\n    from .. import deep\n")
    assert _imports(module) == {"lab.parallel.mesh", "lab", "lab.parallel", "lab.measure", "lab.measure.deep"}


def _lab_imports(path: Path) -> set[str]:
    return {m for m in _imports(path) if m.split(".")[0] == "lab"}


@pytest.mark.slow
def test_lab_imports_nothing_of_the_analysis_or_the_sweeps_built_on_it():
    for path in (ROOT / "lab").rglob("*.py"):
        above = {m for m in _imports(path) if m.split(".")[0] in ("analysis", "sweeps")}
        assert not above, (str(path.relative_to(ROOT)), above)


def test_accounting_depends_on_nothing_in_lab_and_config_not_on_the_model():
    assert _lab_imports(ROOT / "lab" / "measure" / "accounting.py") == set()
    assert _lab_imports(ROOT / "lab" / "runtime" / "config.py") == set()


# bottom to top: a part may import its own and the parts below it, never one above
LAYERS = {"runtime": 0, "measure": 1, "model": 2, "data": 2, "parallel": 3, "training": 4, "commands": 5}


@pytest.mark.slow
def test_lab_is_layered_and_no_part_imports_one_above_it():
    assert {p.name for p in (ROOT / "lab").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    assert {p.name for p in (ROOT / "lab").glob("*.py")} == {"__init__.py", "__main__.py"}  # every module in a part
    for path in (ROOT / "lab").rglob("*.py"):
        inside = path.relative_to(ROOT / "lab").parts
        if len(inside) == 1:  # lab/__init__.py and lab/__main__.py: the top, above every part
            continue
        part = inside[0]
        for module in _lab_imports(path):
            other = module.split(".")[1] if "." in module else None
            assert other is None or LAYERS[other] <= LAYERS[part], (str(path.relative_to(ROOT)), module)


def _module_level_lab_imports() -> dict[str, set[str]]:
    """Each lab module and the lab modules it imports when it is imported (a ``from package import name`` of a
    submodule counts as that submodule)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "lab").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.parse(path.read_text()).body:  # module level: lazy imports inside functions close no circle
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def test_nothing_imports_a_main_module():
    """``__main__`` modules only start their command line: library code lives where it can be imported."""
    folders = ("lab", "analysis", "sweeps", "launch", "benchmarks", "tests")
    found = [(str(path.relative_to(ROOT)), name) for folder in folders for path in (ROOT / folder).rglob("*.py")
             for name in _imports(path) if name.split(".")[-1] == "__main__"]
    assert not found, found


def test_the_law_module_stands_on_numpy_alone():
    """The laws the fits and the training run's expectation share load no torch, no training, no analysis and no
    command line, and no scipy until a curve's areas are asked for."""
    probe = ("import sys; import lab.measure.laws; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('lab', 'analysis', 'sweeps', 'torch', 'scipy', 'pandas')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['lab',", "'lab.measure',", "'lab.measure.laws']"], out.stdout


def test_no_import_circle_in_lab():
    graph, done, path = _module_level_lab_imports(), set(), []

    def visit(module: str) -> None:
        assert module not in path, " -> ".join(path[path.index(module):] + [module])
        if module in done:
            return
        path.append(module)
        for other in sorted(graph[module]):
            visit(other)
        path.pop()
        done.add(module)

    assert graph["lab.parallel.base"] and "lab.parallel.axes" in graph["lab.parallel.base"]  # the graph is read
    for module in sorted(graph):
        visit(module)


@pytest.mark.slow
def test_commands_start_without_the_libraries_only_some_runs_need():
    """Every process a sweep or a launcher starts pays its imports: the sweeps command imports no torch, and a
    training process no scipy or pandas (only ``--train.expect`` reads a law) and no dynamo until something
    compiles or builds an optimizer (tensor parallelism's collectives apply ``torch.compiler.disable`` lazily)."""
    probe = ("import sys; import sweeps.cli; print('torch' in sys.modules); import lab.commands.cli; "
             "print(*(name in sys.modules for name in ('scipy', 'pandas', 'torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False", "False"], out.stdout


def test_one_place_decides_precision_and_the_peak():
    for name in ("training/train.py", "commands/bench.py", "commands/cli.py"):
        source = (ROOT / "lab" / name).read_text()
        for decision in ("torch.autocast", "torch.bfloat16", "get_device_name", "allow_tf32", "gpu_peak_flops",
                         "measure_matmul_peak"):
            assert decision not in source, (name, decision)
        assert "lab.measure.device" in source, name


def test_train_reads_top_to_bottom_in_short_steps():
    tree = ast.parse((ROOT / "lab" / "training" / "lifecycle.py").read_text())
    functions = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert functions["train"] <= 40, functions["train"]
    assert max(functions.values()) <= 80, max(functions.items(), key=lambda kv: kv[1])


def test_the_loop_only_loops_and_names_no_axis_or_model_feature():
    """What a transform or a model feature reports reaches the log through the strategy (``Strategy.take_record``,
    ``Accounts.meters``) and ``lab.parallel.step_line``: train.py names none of them, and stays nanoGPT-sized."""
    source = (ROOT / "lab" / "training" / "train.py").read_text()
    words = set(re.findall(r"[a-z0-9]+", source.lower()))
    named = words & {"tp", "pp", "ep", "cp", "sp", "pipeline", "bubble", "expert", "experts", "router", "routing",
                     "exchange", "exchanges", "a2a", "moe", "mixture", "stage", "stages"}
    assert not named, sorted(named)
    assert len(source.splitlines()) <= 320, len(source.splitlines())
