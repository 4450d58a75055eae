"""DeepSpeed as a strategy: its config, equivalence with single, meters, checkpoints and torchrun, on real gloo ranks.

Engines are built on the CPU accelerator (no C++ op is compiled); each spawned group runs several checks.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.runtime import checkpoint
from lab.commands.cli import export_main, run_main, sample_main
from lab.runtime.config import ConfigError, ParallelConfig, TrainConfig
from lab.measure.device import Precision
from lab.commands.equivalence import Setup, batch, equivalence, loop_settings
from lab.model import GPT
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import LoopSettings, World, parse_spec
from lab.training.plan import create
from lab.parallel.data.deepspeed import engine_config
from pool import run_pooled
from lab.training.train import train_step
from test_checkpoints import _train, final_weights, tree  # noqa: F401 (tree: the tiny run's config, a fixture)

pytestmark = pytest.mark.slow  # launches processes or trains many runs: `make test` only, not test-fast

ROOT = Path(__file__).resolve().parents[1]
LOOP = LoopSettings(micro_batch=4, accum_steps=2, grad_clip=1.0)
STAGES = ["deepspeed:zero_stage=1", "deepspeed:zero_stage=2", "deepspeed:zero_stage=3"]
CHECKPOINTED = ["deepspeed:zero_stage=2,activation_checkpointing=full",
                "deepspeed:zero_stage=3,activation_checkpointing=selective"]
OFFLOADED = ["deepspeed:zero_stage=1,offload=optimizer", "deepspeed:zero_stage=2,offload=optimizer",
             "deepspeed:zero_stage=3,offload=optimizer", "deepspeed:zero_stage=3,offload=all"]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------- the engine's config


def test_the_lab_writes_its_own_values_into_the_engine_config():
    config = engine_config(ParallelConfig(strategy="deepspeed", zero_stage=3, offload="all"), 2, LOOP,
                           Precision("cpu", "bf16"))
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (4, 2, 16, 1.0)
    # bf16 as every strategy runs it: autocast, fp32 weights, gradients reduced in fp32
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"} == zero["offload_param"]
    assert zero["memory_efficient_linear"] is False  # it would patch torch.nn.functional.linear process-wide
    assert "optimizer" not in config and "scheduler" not in config  # the lab's AdamW, the lab's schedule
    assert config["zero_force_ds_cpu_optimizer"] is False and config["comms_logger"]["enabled"] is True


def test_a_user_file_passes_through_and_may_repeat_the_labs_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "train_batch_size": "auto", "wall_clock_breakdown": True,
                                "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000,
                                                      "contiguous_gradients": False}}))
    config = engine_config(ParallelConfig(strategy="deepspeed", deepspeed_config=str(path)), 2, LOOP, Precision("cpu"))
    assert config["wall_clock_breakdown"] is True and config["train_batch_size"] == 16
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000  # a lab default the file may change
    assert config["zero_optimization"]["contiguous_gradients"] is False and config["torch_autocast"]["enabled"] is False


@pytest.mark.parametrize("content, key", [
    ({"gradient_clipping": 0.5}, '"gradient_clipping" is 0.5 but the lab sets 1.0 (from train.grad_clip)'),
    ({"train_micro_batch_size_per_gpu": 8}, '"train_micro_batch_size_per_gpu" is 8 but the lab sets 4 (from '
                                            'train.micro_batch)'),
    ({"gradient_accumulation_steps": 1}, '"gradient_accumulation_steps" is 1 but the lab sets 2'),
    ({"zero_optimization": {"stage": 3}}, '"zero_optimization.stage" is 3 but the lab sets 2 (from '
                                          'parallel.zero_stage)'),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     '"zero_optimization.offload_optimizer.device" is "nvme" but the lab sets "none" (from parallel.offload)'),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, '"optimizer" contradicts the lab: the optimizer is '
                                                             "the lab's AdamW"),
    ({"scheduler": {"type": "WarmupLR"}}, '"scheduler" contradicts the lab: the learning-rate schedule'),
    ({"bf16": {"enabled": True}}, '"bf16" contradicts the lab: precision is the lab\'s (train.dtype'),
    ({"fp16": {"enabled": True}}, '"fp16" contradicts the lab: precision'),
    ({"torch_autocast": {"enabled": True}}, '"torch_autocast.enabled" is true but the lab sets false (from '
                                            'train.dtype)'),
])
def test_a_user_file_that_contradicts_the_lab_is_refused_naming_the_key(tmp_path, content, key):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError) as e:
        engine_config(ParallelConfig(strategy="deepspeed", deepspeed_config=str(path)), 2, LOOP, Precision("cpu"))
    assert str(e.value).startswith(f"parallel.deepspeed_config {path}: {key}"), str(e.value)
    assert "\n" not in str(e.value)


def test_bad_deepspeed_input_fails_before_any_work_with_one_line(tmp_path, args, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 1}, }')
    clip = tmp_path / "clip.json"
    clip.write_text('{"gradient_clipping": 0.25}')
    cases = [(["--parallel.zero_stage", "4"], "parallel.zero_stage must be one of 1, 2, 3, got 4"),
             (["--parallel.offload", "all"], "parallel.offload all (parameters too) needs parallel.zero_stage 3"),
             (["--parallel.deepspeed_config", str(tmp_path / "none.json")], "parallel.deepspeed_config: no such file"),
             (["--parallel.deepspeed_config", str(bad)], "not valid JSON"),
             (["--parallel.deepspeed_config", str(clip)], '"gradient_clipping" is 0.25 but the lab sets 1.0')]
    for extra, message in cases:
        run_dir = tmp_path / "r"
        assert run_main([*args, "--strategy", "deepspeed", *extra, "--run-dir", str(run_dir)]) == 2
        assert message in one_error_line(capsys.readouterr().err)
        assert not run_dir.exists()
    assert run_main([*args, "--strategy", "zero2", "--parallel.offload", "all", "--run-dir", str(run_dir)]) == 2
    assert "parallel.offload must be one of none, optimizer, got 'all'" in one_error_line(capsys.readouterr().err)


@pytest.mark.long
def test_without_deepspeed_installed_choosing_it_fails_at_once_naming_the_extra(tmp_path, args):
    hide = ("import sys; sys.modules['deepspeed'] = None; from lab.commands.cli import run_main; "
            "sys.exit(run_main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", hide, *args, "--strategy", "deepspeed", "--run-dir",
                           str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert line.startswith("error: strategy 'deepspeed' needs DeepSpeed, which is not installed")
    assert line.endswith("install the extra: pip install '.[deepspeed]'")
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- equivalence with single on 2 ranks


def _equivalences(world: World) -> dict:
    # one micro-batch per rank, no clipping: sums of two numbers and exact halving (see lab.commands.equivalence)
    exact = equivalence(world, [*STAGES, *OFFLOADED], Setup(steps=4, grad_clip=0))
    # accumulation, clipping active (norms near 1 at lr 1e-2), checkpointing: regrouped sums
    traces: dict = {}
    regrouped = equivalence(world, [*STAGES, *OFFLOADED, *CHECKPOINTED], Setup(steps=4, accum=2, grad_clip=0.5),
                            traces=traces)
    saved = {spec: trace.meters["activation_saved_bytes"] for spec, trace in traces.items()}
    # the lab's bf16 (autocast, fp32 weights and gradients) written into the engine as torch_autocast
    bf16 = equivalence(world, STAGES, Setup(steps=4, grad_clip=0, dtype="bf16"))
    return {"exact": exact, "regrouped": regrouped, "bf16": bf16, "saved": saved}


@pytest.fixture(scope="module")
def equivalences():
    return run_pooled(_equivalences, 2, deadline_s=600)[0]


def test_every_stage_with_and_without_offload_reproduces_single_bit_for_bit_on_two_ranks(equivalences):
    assert set(equivalences["exact"]) == {*STAGES, *OFFLOADED}
    for spec, r in equivalences["exact"].items():
        assert r.same_losses and r.same_params, (spec, r)
        assert r.max_rel_grad_norm_diff <= 1e-6, (spec, r)  # DeepSpeed sums the norm per partition


def test_bf16_autocast_in_the_engine_reproduces_single_under_the_same_autocast(equivalences):
    assert set(equivalences["bf16"]) == set(STAGES)
    for spec, r in equivalences["bf16"].items():
        assert r.same_losses and r.same_params, (spec, r)


def test_with_accumulation_clipping_and_checkpointing_every_stage_matches_single(equivalences):
    for spec, r in equivalences["regrouped"].items():
        # the bar for losses; parameters within a tenth of one AdamW step at lr 1e-2
        assert r.max_rel_loss_diff <= 1e-4 and r.max_rel_grad_norm_diff <= 1e-5, (spec, r)
        assert r.max_param_diff <= 1e-3, (spec, r)


def test_checkpointing_under_the_engine_saves_what_it_does_under_the_lab(equivalences):
    """The engine's model is checkpointed as every strategy's is: a micro-step keeps fewer activation bytes for its
    backward than the same stage without checkpointing (full: at most a third)."""
    saved = equivalences["saved"]
    assert 0 < saved[CHECKPOINTED[0]] <= saved["deepspeed:zero_stage=2"] / 3, saved
    assert 0 < saved[CHECKPOINTED[1]] < saved["deepspeed:zero_stage=3"], saved


# ---------------------------------------------------------------- meters, skipped steps, one rank's view


def _trained(world: World, spec: str, steps: int = 2, poison_step: int | None = None) -> dict:
    setup = Setup(steps=steps)
    s = create(parse_spec(spec), world, Precision("cpu"), loop_settings(setup))
    s.build(lambda: GPT(setup.model, seed=setup.seed), lambda m: param_groups(m, 0.1),
            adamw_factory(TrainConfig(), world.device))
    out = {"stepped": []}
    for step in range(steps):
        x, y = batch(setup, step, setup.micro_batch * world.world_size)
        lo = world.rank * setup.micro_batch
        if step == poison_step:
            out["before"] = s.full_state_dict()
            loss = s.forward(x[lo:lo + setup.micro_batch], y[lo:lo + setup.micro_batch], sync=True)
            loss.register_hook(lambda g: g * math.inf)  # a finite loss whose gradient is not
            s.backward(loss)
            norm = s.clip_grad_norm(setup.grad_clip)
            out["norm"] = norm.item()
            s.skip_step()
            out["after"] = s.full_state_dict()
        else:
            micro = [(x[lo:lo + setup.micro_batch], y[lo:lo + setup.micro_batch])]
            out["stepped"].append(train_step(s, world, micro, 1, setup.lr, setup.grad_clip).grad_norm)
        s.take_step_meters()
    out["meters"] = s.accounts.meters()
    out["psi"] = s.accounts.param_count()
    return out


def _meters_and_skips(world: World) -> dict:
    out = {spec: _trained(world, spec) for spec in STAGES}
    out["skip"] = {spec: _trained(world, spec, steps=3, poison_step=1) for spec in ("deepspeed:zero_stage=2",
                                                                                  "deepspeed:zero_stage=3")}
    return out


@pytest.fixture(scope="module")
def meters_and_skips():
    return run_pooled(_meters_and_skips, 2, deadline_s=600)[0]


def test_model_state_bytes_are_measured_from_the_engines_tensors(meters_and_skips):
    for stage, spec in enumerate(STAGES, start=1):
        m = meters_and_skips[spec]["meters"]
        measured, theory, psi = m["model_state_bytes"], m["model_state_bytes_theory"], meters_and_skips[spec]["psi"]
        assert measured["params"] == theory["params"] == 4 * psi / (2 if stage == 3 else 1), (spec, m)
        # DeepSpeed keeps its own fp32 master of the rank's partition beside the weights (+4 bytes per
        # parameter over N), and one step counter per flat group
        assert theory["optimizer"] == 8 * psi / 2
        assert 12 * psi / 2 <= measured["optimizer"] <= 12 * psi / 2 + 64, (spec, m)
        # at the step boundary every stage holds only the reduced gradients of its partition's parameters
        # (whole parameters at the partition's edges in stages 1-2)
        assert 4 * psi / 2 <= measured["grads"] <= 1.25 * 4 * psi / 2, (spec, m)


def test_communication_is_counted_from_deepspeeds_comms_logger(meters_and_skips):
    for stage, spec in enumerate(STAGES, start=1):
        m = meters_and_skips[spec]["meters"]
        sent, theory, psi = m["comm_bytes_per_step"], m["comm_bytes_per_step_theory"], meters_and_skips[spec]["psi"]
        ring = 4 * psi / 2  # fp32 bytes a rank sends for one reduce-scatter or all-gather of Ψ on 2 ranks
        assert theory["reduce_scatter"] == ring
        if stage < 3:  # DeepSpeed all-reduces the gradient buckets, then all-gathers the updated weights
            assert sent["all_reduce"] == 2 * ring and sent["reduce_scatter"] == 0, (spec, sent)
            assert sent["all_gather"] == theory["all_gather"] == ring, (spec, sent)
        else:  # the weights gathered for the forward stay until the backward on this small model
            assert sent["reduce_scatter"] == ring and sent["all_gather"] == ring and sent["all_reduce"] == 0
            assert theory["all_gather"] == 2 * ring


def test_a_non_finite_gradient_leaves_the_weights_and_training_goes_on(meters_and_skips):
    for spec, out in meters_and_skips["skip"].items():
        assert out["norm"] == float("inf"), spec
        assert out["before"].keys() == out["after"].keys() and out["before"]
        assert all(torch.equal(out["before"][k], out["after"][k]) for k in out["before"]), spec
        assert len(out["stepped"]) == 2 and all(0 < n < float("inf") for n in out["stepped"]), (spec, out["stepped"])


# ---------------------------------------------------------------- checkpoints, export and sampling


def segment(tree: dict, data_dir: Path, run_dir: Path, spec: str, n: int, resume: bool, **train_opts) -> int:
    """One run segment under ``spec`` (``name[:key=value,...]``) on ``n`` ranks (4 ranks: smaller micro-batches)."""
    name, _, options = spec.partition(":")
    parallel = {"strategy": name, **dict(kv.split("=") for kv in options.split(",") if kv)}
    opts = {"micro_batch": 2, **train_opts} if n == 4 else train_opts
    return run_pooled(_train, n, {**tree, "train": {**tree["train"], **opts}, "parallel": parallel}, data_dir, run_dir,
                     resume)[0]


@pytest.fixture(scope="module")
def single_weights(tree, tiny_prepared, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    assert segment(tree, tiny_prepared, run_dir, "single", 1, False) == 8
    return final_weights(run_dir)


@pytest.mark.long
@pytest.mark.parametrize("saved, resumed", [
    (("deepspeed:zero_stage=3", 2), ("zero2", 4)),
    (("zero3", 2), ("deepspeed:zero_stage=1,offload=optimizer", 2)),
    (("deepspeed:zero_stage=2", 2), ("single", 1)),
])
def test_deepspeed_runs_resume_under_other_strategies_and_the_other_way(tree, tiny_prepared, tmp_path, single_weights,
                                                                        saved, resumed):
    run_dir = tmp_path / "r"
    assert segment(tree, tiny_prepared, run_dir, *saved, False, stop_after=4) == 4
    assert segment(tree, tiny_prepared, run_dir, *resumed, True) == 8
    got = final_weights(run_dir)
    assert got.keys() == single_weights.keys()
    # the equivalence tolerance: regrouped fp32 sums carried by AdamW
    assert max((got[k] - single_weights[k]).abs().max().item() for k in got) <= 1e-3


def test_the_same_deepspeed_run_resumes_bit_for_bit_and_exports_and_samples(tree, tiny_prepared, tmp_path, capsys):
    whole, r, spec = tmp_path / "whole", tmp_path / "r", "deepspeed:zero_stage=3,offload=optimizer"
    assert segment(tree, tiny_prepared, whole, spec, 2, False) == 8
    assert segment(tree, tiny_prepared, r, spec, 2, False, stop_after=3) == 3
    assert segment(tree, tiny_prepared, r, spec, 2, True) == 8
    a, b = (checkpoint.load_everything(checkpoint.latest(d)) for d in (whole, r))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["optim/wte.weight/step"] == 8 and "optim/wte.weight/exp_avg_sq" in a
    assert export_main([str(r), "--out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported["step"] == 8 and all(torch.equal(exported["model"][k], a[f"model/{k}"].view_as(v))
                                         for k, v in exported["model"].items())
    capsys.readouterr()
    assert sample_main(["--run-dir", str(r), "--prompt", "The Union", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The Union")


# ---------------------------------------------------------------- torchrun, as the README runs it


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.long
def test_torchrun_two_ranks_and_one_process_train_as_single_does(args, tmp_path):
    # an empty extension cache: nothing may be compiled into it
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = {"one process": [sys.executable, "launch/run.py", "--strategy", "deepspeed", "--parallel.zero_stage", "3",
                            "--parallel.offload", "all"],
            "torchrun": [*torchrun, "launch/run.py", "--strategy", "deepspeed"]}
    assert run_main([*args, "--run-dir", str(tmp_path / "single")]) == 0  # the reference needs no launcher
    losses = {"single": train_losses(tmp_path / "single")}
    for name, command in runs.items():
        run_dir = tmp_path / name.replace(" ", "-")
        proc = subprocess.run([*command, *args, "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert "done (completed): 8 steps" in proc.stdout, name
        losses[name] = train_losses(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["model_state_bytes"]["total"] > 0
    assert "strategy deepspeed (ZeRO stage 2) × 2" in proc.stdout and summary["world_size"] == 2
    assert sum(summary["comm_bytes_per_step"].values()) > 0
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())
    for name in ("one process", "torchrun"):
        assert len(losses[name]) == 8
        assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(losses["single"], losses[name])), (name, losses)
