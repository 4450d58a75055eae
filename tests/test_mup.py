"""μP (model.parametrization mup): initialisation, per-layer learning rates under every strategy, checkpoints."""

import dataclasses
import json

import pytest
import torch

from lab.commands import mup
from lab.commands.entry import main as lab_main
from lab.runtime.config import ConfigError, ModelConfig, TrainConfig
from lab.measure.device import Precision
from lab.commands.equivalence import TINY, Setup, batch, equivalence
from lab.model import GPT, validate
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import LoopSettings, World, parse_spec
from lab.training.plan import create
from pool import run_pooled
from test_checkpoints import final_weights, segment, tree  # noqa: F401 (tree: the tiny run's config, a fixture)
from test_train import assert_states_equal, final_state, run, train_losses

HIDDEN = ("attn.qkv.weight", "attn.proj.weight", "mlp.up.weight", "mlp.down.weight")  # in each block, both arches
MUP_TINY = dataclasses.replace(TINY, d_model=64, parametrization="mup", mup_base_width=16)  # width ratio m = 4
LR = 1e-2


def pair(arch: str, d_model: int, base: int, **kw) -> tuple[GPT, GPT]:
    """A standard and a μP model of one shape and seed."""
    shape = dict(arch=arch, n_layer=2, n_head=2, d_model=d_model, block_size=16, vocab_size=64, **kw)
    return (GPT(ModelConfig(**shape), seed=3),
            GPT(ModelConfig(**shape, parametrization="mup", mup_base_width=base), seed=3))


def is_hidden_name(name: str) -> bool:
    return name.startswith("blocks.") and name.endswith(HIDDEN)


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_hidden_matrices_start_at_std_over_root_m_and_train_at_lr_over_m(arch):
    standard, mup = pair(arch, d_model=128, base=32)  # m = 4
    sd, md = dict(standard.named_parameters()), dict(mup.named_parameters())
    hidden = [n for n in md if is_hidden_name(n)]
    assert len(hidden) == 2 * 4
    for name in md:
        if name in hidden:
            assert torch.allclose(md[name], sd[name] / 2, rtol=1e-6, atol=0), name  # std / √4, same draws
            assert mup.lr_multiplier(name) == 0.25
        else:
            assert torch.equal(md[name], sd[name]), name  # embeddings, norms, biases: as standard
            assert mup.lr_multiplier(name) == 1.0
    qkv = md["blocks.0.attn.qkv.weight"]
    assert qkv.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    groups = {g.lr_scale: set(g.names) for g in param_groups(mup, 0.1) if g.weight_decay > 0}
    assert groups == {0.25: set(hidden), 1.0: {n for n in md if n in ("wte.weight", "wpe.weight")}}
    assert {g.lr_scale for g in param_groups(standard, 0.1)} == {1.0}


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_at_the_base_width_mup_is_standard_but_for_the_attention_scale(arch):
    standard, mup = pair(arch, d_model=64, base=64)  # m = 1
    assert all(torch.equal(a, b) for a, b in zip(standard.parameters(), mup.parameters(), strict=True))
    assert ([(g.names, g.weight_decay, g.lr_scale) for g in param_groups(standard, 0.1)]
            == [(g.names, g.weight_decay, g.lr_scale) for g in param_groups(mup, 0.1)])
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(standard(idx), mup(idx))  # scores scaled by 1/d_head, not 1/√d_head
    for block in mup.blocks:
        block.attn.scale = None  # torch's default 1/√d_head
    assert torch.equal(standard(idx), mup(idx))


def test_the_logits_are_multiplied_by_base_over_width():
    standard, mup = pair("gpt2", d_model=128, base=32, tie_embeddings=False)
    with torch.no_grad():
        mup.load_state_dict(standard.state_dict())
    for block in mup.blocks:
        block.attn.scale = None
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(mup(idx), standard(idx) / 4, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("changes, message", [
    (dict(parametrization="mu"), "model.parametrization must be standard or mup, got 'mu' (did you mean mup?)"),
    (dict(mup_base_width=32), "model.mup_base_width has no effect under model.parametrization standard"),
    (dict(parametrization="mup", mup_base_width=0), "model.mup_base_width must be positive, got 0"),
])
def test_bad_mup_settings_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        validate(ModelConfig(vocab_size=64, **changes))


def test_bad_mup_settings_fail_the_run_with_one_line(tmp_path, args, capsys):
    assert run(tmp_path / "r", *args, "--model.mup_base_width", "16") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model.mup_base_width has no effect under model.parametrization standard "
        "(set model.parametrization mup)"]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- the rates reach every strategy's optimizer


def _first_step_multipliers(world: World, specs: list[str]) -> dict[str, dict[str, float]]:
    """Per strategy, each parameter's largest |update| / lr after one AdamW step without weight decay.

    Adam's first update is lr·g/(|g|+ε): at most lr, and lr to many digits for every element whose
    gradient is well above ε = 1e-8, so the largest change is the group's learning rate.
    """
    out = {}
    loop = LoopSettings(micro_batch=2, accum_steps=1, grad_clip=0.0)
    for spec in specs:
        here = World(rank=0, world_size=1, local_rank=0, device=world.device) if spec == "single" else world
        strategy = create(parse_spec(spec), here, Precision("cpu"), loop)
        strategy.build(lambda: GPT(MUP_TINY, seed=5), lambda m: param_groups(m, 0.0),
                       adamw_factory(TrainConfig(), world.device))
        before = strategy.full_state_dict()
        x, y = batch(Setup(model=MUP_TINY), 0, 2 * here.world_size)
        rows = slice(2 * here.rank, 2 * here.rank + 2)
        strategy.backward(strategy.forward(x[rows], y[rows], sync=True))
        strategy.step(LR)
        after = strategy.full_state_dict()
        if here.is_main:
            out[spec] = {k: ((after[k] - before[k]).abs().max() / LR).item() for k in before}
    return out


def assert_multipliers(seen: dict[str, float]) -> None:
    model = GPT(MUP_TINY)
    assert seen.keys() == dict(model.named_parameters()).keys()
    for name, ratio in seen.items():
        assert ratio == pytest.approx(model.lr_multiplier(name), rel=1e-3), name
    assert {model.lr_multiplier(n) for n in seen} == {0.25, 1.0}


def _mup_equivalence(world: World, specs: list[str]) -> tuple[dict, dict]:
    # one micro-batch per rank, no clipping: bitwise (see lab.commands.equivalence)
    return (equivalence(world, specs, Setup(steps=4, grad_clip=0, model=MUP_TINY)),
            _first_step_multipliers(world, ["single", *specs]))


@pytest.mark.slow
def test_per_layer_rates_survive_every_data_parallel_strategy_sharding_and_offload_on_two_ranks():
    specs = ["ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp", "zero1:offload=optimizer",
             "zero2:offload=optimizer", "zero3:offload=optimizer", "fsdp:offload=optimizer"]
    exact, multipliers = run_pooled(_mup_equivalence, 2, specs)[0]
    for spec in specs:  # sharded strategies add the norm's squares per shard: its last bits may differ
        r = exact[spec]
        assert r.same_losses and r.same_params and r.max_rel_grad_norm_diff <= 1e-6, (spec, r)
    assert multipliers.keys() == {"single", *specs}
    for seen in multipliers.values():
        assert_multipliers(seen)


@pytest.mark.slow
def test_per_layer_rates_reach_deepspeeds_optimizer_on_two_ranks():
    specs = ["deepspeed:zero_stage=1", "deepspeed:zero_stage=2", "deepspeed:zero_stage=3,offload=optimizer"]
    exact, multipliers = run_pooled(_mup_equivalence, 2, specs, deadline_s=600)[0]
    for spec in specs:
        assert exact[spec].same_losses and exact[spec].same_params, (spec, exact[spec])
        assert_multipliers(multipliers[spec])


# ---------------------------------------------------------------- checkpoints


MUP_ARGS = ("--model.parametrization", "mup", "--model.mup_base_width", "16")  # d_model 32: m = 2


@pytest.mark.slow
def test_a_mup_run_resumes_bit_for_bit_and_differs_from_standard(tmp_path, args):
    assert run(tmp_path / "full", *args, *MUP_ARGS) == 0
    assert run(tmp_path / "part", *args, *MUP_ARGS, "--train.stop_after", "3") == 0
    assert run(tmp_path / "part", *args, *MUP_ARGS, "--resume") == 0
    assert train_losses(tmp_path / "part") == train_losses(tmp_path / "full")
    assert_states_equal(final_state(tmp_path / "part"), final_state(tmp_path / "full"))
    assert run(tmp_path / "standard", *args) == 0
    assert train_losses(tmp_path / "standard")[1:] != train_losses(tmp_path / "full")[1:]


@pytest.mark.slow
def test_a_mup_run_saved_by_single_resumes_under_zero2_on_two_ranks(tree, tiny_prepared, tmp_path):  # noqa: F811
    mup = {**tree, "model": {**tree["model"], "parametrization": "mup", "mup_base_width": 16}}
    assert segment(mup, tiny_prepared, tmp_path / "whole", "single", 1, False) == 8
    assert segment(mup, tiny_prepared, tmp_path / "r", "single", 1, False, stop_after=4) == 4
    assert segment(mup, tiny_prepared, tmp_path / "r", "zero2", 2, True) == 8
    got, ref = final_weights(tmp_path / "r"), final_weights(tmp_path / "whole")
    # a hidden matrix trained at lr rather than lr/2 for 4 steps would be ~1e-2 away
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-3


# ---------------------------------------------------------------- the coordinate check


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_coordinate_check_is_flat_under_mup_and_grows_under_standard(arch):
    result = mup.coord_check([32, 64, 128], steps=2, arch=arch, n_layer=1, block_size=32, sequences=4, seeds=1,
                             data=mup.corpus_bytes(50_000))
    layers = ["embedding", "block0.attn", "block0.mlp", "logits"]
    for parametrization in ("standard", "mup"):
        assert sorted(result[parametrization]) == [32, 64, 128]
        assert all(list(scales) == layers for scales in result[parametrization].values())
    for layer in layers:  # every layer within 1.6× across a 4× range of widths (seen: at most 1.4×)
        assert mup.spread(result["mup"], layer) <= 1.6, (layer, result["mup"])
    assert mup.spread(result["standard"], "embedding") <= 1.6  # Adam moves embeddings alike at any width
    for layer in layers[1:]:  # hidden outputs and logits grow with width (seen: 3.4× to 19×)
        assert mup.growth(result["standard"], layer) >= 2.5, (layer, result["standard"])


@pytest.mark.slow
def test_mup_check_prints_the_table_and_writes_the_figure(tmp_path, capsys):
    out = tmp_path / "check.png"
    assert lab_main(["mup-check", "--widths", "32,64", "--steps", "1", "--seeds", "1", "--n-layer", "1",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "standard: mean |x| by width" in text and "mup: mean |x| by width" in text and "block0.mlp" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--widths", "32"], "argument --widths: expected at least two positive widths, got '32'"),
    (["--widths", "32,48", "--n-head", "5"], "--n-head 5 must divide every width ([32, 48])"),
    (["--out", "x.svg"], "--out must be a .png file in an existing folder, got x.svg"),
])
def test_mup_check_refuses_bad_input_with_one_line(argv, message, capsys):
    try:
        code = lab_main(["mup-check", *argv])
    except SystemExit as e:  # argparse's errors exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_a_run_written_before_the_parametrization_options_existed_still_resumes(tmp_path, args, capsys):
    assert run(tmp_path / "old", *args, "--train.stop_after", "3") == 0
    config = tmp_path / "old" / "config.json"
    written = json.loads(config.read_text())
    del written["model"]["parametrization"], written["model"]["mup_base_width"]
    config.write_text(json.dumps(written))
    assert run(tmp_path / "old", *args, "--resume") == 0
    assert run(tmp_path / "mup", *args, "--train.stop_after", "3") == 0
    assert run(tmp_path / "mup", *args, *MUP_ARGS, "--resume") == 2  # the parametrization defines the run
    assert "--resume cannot change model.mup_base_width, model.parametrization" in capsys.readouterr().err
