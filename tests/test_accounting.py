"""Accounting against hand computations (each written out), the live model, and the plan CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.measure import accounting as acc
from lab.measure import fits, hardware
from lab.runtime.config import ModelConfig, resolve
from lab.commands.resources import main

ROOT = Path(__file__).resolve().parents[1]

GPT2_124M = ModelConfig(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50257, arch="gpt2",
                        tie_embeddings=True)
# Small shapes used by several tests below.
GPT2_UNTIED = ModelConfig(arch="gpt2", n_layer=2, n_head=2, d_model=64, block_size=32, vocab_size=100,
                          pad_vocab_to=64, tie_embeddings=False)
MODERN_GQA = ModelConfig(arch="modern", n_layer=2, n_head=4, n_kv_head=2, d_model=64, block_size=32, vocab_size=100)


# ---------------------------------------------------------------- parameters


def test_gpt2_124m_count() -> None:
    d, L, V, T = 768, 12, 50257, 1024
    norm = 2 * d  # LayerNorm weight + bias
    qkv = d * 3 * d + 3 * d  # 1,771,776
    proj = d * d + d  # 590,592
    mlp = d * 4 * d + 4 * d + 4 * d * d + d  # 4,722,432
    block = 2 * norm + qkv + proj + mlp  # 7,087,872
    total = V * d + T * d + L * block + norm  # tied head adds nothing
    assert total == 124_439_808
    c = acc.param_counts(GPT2_124M)
    assert c.total == 124_439_808
    assert c.embedding == V * d + T * d == 39_383_808
    assert c.non_embedding == 85_056_000 and c.head == 0 and c.position == 786_432


def test_gpt2_untied_padded_count() -> None:
    # d=64, 2 heads, ff=256, vocab 100 padded to 128, 32 positions, biases.
    block = 2 * (2 * 64) + (64 * 192 + 192) + (64 * 64 + 64) + (2 * 64 * 256 + 256 + 64)
    assert block == 256 + 12_480 + 4_160 + 33_088 == 49_984
    non_embedding = 2 * block + 2 * 64  # 100,096
    embedding = 128 * 64 + 32 * 64  # 10,240
    head = 128 * 64  # 8,192
    c = acc.param_counts(GPT2_UNTIED)
    assert (c.non_embedding, c.embedding, c.head, c.position) == (100_096, 10_240, 8_192, 2_048)
    assert c.total == non_embedding + embedding + head == 118_528


def test_modern_gqa_count() -> None:
    # d=64, 4 query heads of 16, 2 kv heads, SwiGLU ff = round_up(int(8·64/3) = 170, 64) = 192, RMSNorm, no bias.
    assert acc.ffn_width(MODERN_GQA) == 192 and acc.kv_heads(MODERN_GQA) == 2
    qkv = 64 * (64 + 2 * 2 * 16)  # 8,192
    block = 2 * 64 + qkv + 64 * 64 + 3 * 64 * 192  # 128 + 8,192 + 4,096 + 36,864 = 49,280
    c = acc.param_counts(MODERN_GQA)
    assert c.position == 0 and c.head == 0
    assert c.total == 100 * 64 + 2 * block + 64 == 105_024


@pytest.mark.parametrize("cfg", [
    GPT2_124M, GPT2_UNTIED, MODERN_GQA,
    ModelConfig(arch="gpt2", n_layer=2, n_head=4, d_model=64, vocab_size=77, bias=False),
    ModelConfig(arch="modern", n_layer=1, n_head=4, d_model=64, vocab_size=77, bias=True, tie_embeddings=False),
])
def test_counts_match_the_model(cfg: ModelConfig) -> None:
    torch = pytest.importorskip("torch")
    from lab.model import GPT

    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = GPT(cfg)
    assert acc.param_counts(cfg) == model.param_counts()


def test_flops_per_token_small() -> None:
    # N_matmul = blocks + final norm + the 128×64 head = 100,096 + 8,192; attention 12·L·d·T = 12·2·64·32.
    assert acc.param_counts(GPT2_UNTIED).matmul == 108_288
    assert acc.flops_per_token(GPT2_UNTIED) == 6 * 108_288 + 12 * 2 * 64 * 32 == 698_880


# ---------------------------------------------------------------- hardware and time


def test_peaks_are_dense() -> None:
    assert hardware.gpu_peak_flops("H100") == 989e12 != 1979e12
    assert hardware.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert hardware.gpu_peak_flops("a100") == 312e12 and hardware.gpu_peak_flops("H200") == 989e12
    assert max(t["bf16"] for t in hardware.GPU_PEAK_FLOPS.values()) == 989e12
    assert hardware.gpu_memory_bytes("H200") == 141e9
    with pytest.raises(ValueError, match="unknown GPU"):
        hardware.gpu_peak_flops("V100")


def test_70b_on_15t_tokens_1024_h100_half_mfu() -> None:
    flops = 6 * 70e9 * 15e12  # 6.3e24
    rate = 1024 * 989e12 * 0.5  # 5.06368e17 FLOP/s
    days = flops / rate / 86_400  # 12,441,544 s ≈ 144.0 days
    assert acc.training_flops(70e9, 15e12) == pytest.approx(6.3e24)
    assert hardware.training_days(70e9, 15e12, "H100", 1024, 0.5) == pytest.approx(days)
    assert days == pytest.approx(144.0, abs=0.01)
    with pytest.raises(ValueError):
        hardware.training_days(70e9, 15e12, "H100", 1024, 1.5)


# ---------------------------------------------------------------- model states


def test_naive_adamw_on_8_h100() -> None:
    # fp32 AdamW: 4 + 4 + 8 = 16 B/param. Replicated (ddp) every GPU holds all of it: 80e9 / 16 = 5e9.
    assert acc.model_state_bytes(1, "ddp", 8, "fp32").gpu == 16
    assert fits.largest_model(80e9, 8, "ddp", "fp32") == 5_000_000_000
    # Pooling the 8 GPUs (fully sharded, zero3) gives CS336's answer: 8 × 80e9 / 16 = 40e9.
    assert fits.largest_model(80e9, 8, "zero3", "fp32") == 40_000_000_000
    assert fits.largest_model(80e9, 8, "zero3", "fp32", usable=0.9) == 36_000_000_000


@pytest.mark.parametrize("n, expected", [
    # mixed precision, K = 12: ddp 2+2+12; zero1 2+2+12/N; zero2 2+(2+12)/N; zero3 (2+2+12)/N
    (8, {"ddp": 16, "zero1": 4 + 1.5, "zero2": 2 + 1.75, "zero3": 2}),
    (64, {"ddp": 16, "zero1": 4 + 0.1875, "zero2": 2 + 0.21875, "zero3": 0.25}),
])
def test_zero_rows_mixed(n: int, expected: dict[str, float]) -> None:
    for strategy, per_param in expected.items():
        assert acc.model_state_bytes(1e9, strategy, n).gpu == pytest.approx(per_param * 1e9)
        assert fits.largest_model(80e9, n, strategy) == pytest.approx(80e9 / per_param, abs=1)


@pytest.mark.parametrize("n, expected", [
    # fp32, K = 8: ddp 4+4+8; zero1 4+4+8/N; zero2 4+(4+8)/N; zero3 16/N
    (8, {"ddp": 16, "zero1": 8 + 1, "zero2": 4 + 1.5, "zero3": 2}),
    (64, {"ddp": 16, "zero1": 8 + 0.125, "zero2": 4 + 0.1875, "zero3": 0.25}),
])
def test_zero_rows_fp32(n: int, expected: dict[str, float]) -> None:
    for strategy, per_param in expected.items():
        assert acc.model_state_bytes(1e9, strategy, n, "fp32").gpu == pytest.approx(per_param * 1e9)


def test_zero_paper_table_1() -> None:
    # Rajbhandari et al. 2019, Table 1: Ψ = 7.5B, N_d = 64 → 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    got = [acc.model_state_bytes(7.5e9, s, 64).gpu / 1e9 for s in acc.STRATEGIES]
    assert got == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.05)


def test_offload_moves_optimizer_states_to_host() -> None:
    # zero2, mixed, N = 8: GPU keeps 2Ψ weights + 2Ψ/8 grads; host takes 12Ψ/8.
    s = acc.model_state_bytes(1e9, "zero2", 8, offload=True)
    assert (s.gpu, s.cpu) == (pytest.approx(2.25e9), pytest.approx(1.5e9))
    # fp32: the host also keeps an fp32 master copy beside the two moments: (4 + 8)·Ψ/N
    fp32 = acc.model_state_bytes(1e9, "zero3", 4, "fp32", offload=True)
    assert (fp32.gpu, fp32.cpu) == (pytest.approx(2e9), pytest.approx(3e9))
    ddp = acc.model_state_bytes(1e9, "ddp", 8, offload=True)
    assert (ddp.gpu, ddp.cpu, ddp.total) == (4e9, 12e9, 16e9)
    assert fits.largest_model(80e9, 8, "ddp", offload=True) == 20_000_000_000  # 80e9 / 4


def test_comm_per_step_keeps_the_rank_count() -> None:
    # Ring: an all-reduce of Ψ sends 2(N-1)/N·Ψ per rank; reduce-scatter and all-gather (N-1)/N·Ψ each.
    assert [acc.comm_elements_per_step(1e9, s, 2) for s in acc.STRATEGIES] == [1e9, 1e9, 1e9, 1.5e9]
    assert [acc.comm_elements_per_step(1e9, s, 4) for s in acc.STRATEGIES] == [1.5e9, 1.5e9, 1.5e9, 2.25e9]
    assert acc.comm_elements_per_step(1e9, "ddp", 1) == 0  # one rank sends nothing
    # The large-N limits of the ZeRO paper: 2Ψ for ddp/zero1/zero2, 3Ψ for zero3.
    assert acc.comm_elements_per_step(1e9, "zero3", 10**6) == pytest.approx(3e9, rel=1e-5)
    by_kind = acc.comm_bytes_per_step(1000, "zero3", 4)  # fp32
    assert by_kind == {"all_reduce": 0, "reduce_scatter": 3000, "all_gather": 6000, "broadcast": 0}
    assert acc.comm_bytes_per_step(1000, "ddp", 4)["all_reduce"] == 6000


def test_bad_state_inputs() -> None:
    for kwargs in ({"strategy": "fsdp"}, {"strategy": "ddp", "precision": "fp8"}, {"strategy": "ddp", "n_devices": 0}):
        with pytest.raises(ValueError):
            acc.model_state_bytes(1e9, **kwargs)


# ---------------------------------------------------------------- activations


def test_activation_bytes_small() -> None:
    # GPT2_UNTIED: s=32, b=2, h=64, a=2, L=2, V=128.
    sbh = 32 * 2 * 64  # 4,096
    layer = sbh * 34  # 139,264 (flash: no 5·a·s/h term)
    logits = 4 * 32 * 2 * 128  # 32,768, fp32
    assert acc.activation_bytes(GPT2_UNTIED, 2) == 2 * layer + logits == 311_296
    naive_layer = sbh * (34 + 5 * 2 * 32 / 64)  # + 5·a·s²·b = 20,480 → 159,744
    assert acc.activation_bytes(GPT2_UNTIED, 2, flash=False) == 2 * naive_layer + logits == 352_256
    ckpt = 2 * (2 * sbh) + layer + logits  # layer inputs + one layer recomputed + logits = 188,416
    assert acc.activation_bytes(GPT2_UNTIED, 2, checkpointing=True) == ckpt == 188_416
    # fp32 activations: 16 values at 4 bytes + 2 one-byte masks per token and channel.
    assert acc.activation_bytes(GPT2_UNTIED, 2, bytes_per_act=4) == 2 * sbh * 66 + logits
    # tp 2 (Korthikanti's 10 + 24/t): norms' and column inputs and masks whole, the rest and the logits halved.
    assert acc.activation_bytes(GPT2_UNTIED, 2, tp=2) == 2 * sbh * (10 + 24 / 2) + logits / 2 == 196_608
    # sequence parallel: only the two gathered column inputs (4 bytes) stay whole: 4 + 30/2, not Megatron's 34/2.
    assert acc.activation_bytes(GPT2_UNTIED, 2, tp=2, sequence_parallel=True) == 2 * sbh * 19 + logits / 2
    assert acc.activation_bytes(GPT2_UNTIED, 2, checkpointing=True, tp=2, sequence_parallel=True) == (
        2 * 2 * sbh / 2 + sbh * 19 + logits / 2)


def test_checkpointing_reduces_activations() -> None:
    deep = ModelConfig(n_layer=24, n_head=16, d_model=1024, block_size=1024, vocab_size=50257)
    sbh, logits = 1024 * 8 * 1024, 4 * 1024 * 8 * 50257
    full = acc.activation_bytes(deep, 8)
    ckpt = acc.activation_bytes(deep, 8, checkpointing=True)
    assert full == 24 * 34 * sbh + logits
    assert ckpt == (24 * 2 + 34) * sbh + logits  # layer inputs + one layer being recomputed
    assert ckpt < full


def test_largest_depth_at_the_boundary() -> None:
    # GPT2_UNTIED width, ddp mixed (16 B/param), micro-batch 2:
    # fixed: 16·(final norm 128 + embeddings 10,240 + head 8,192) + logits 32,768 = 296,960 + 32,768
    # per layer: 16·49,984 params + 139,264 activations = 939,008
    fits_three = 329_728 + 3 * 939_008
    fit = fits.largest_depth(GPT2_UNTIED, 2, fits_three, 1, "ddp")
    assert fit == fits.DepthFit(n_layer=3, params=18_560 + 3 * 49_984, gpu_bytes=fits_three)
    assert fits.largest_depth(GPT2_UNTIED, 2, fits_three - 1, 1, "ddp").n_layer == 2
    assert fits.largest_depth(GPT2_UNTIED, 2, 329_728 + 939_008 - 1, 1, "ddp") is None
    # checkpointing: fixed 329,728 + one layer's 139,264 = 468,992; per layer 16·49,984 + 2·4,096 = 807,936
    budget = 468_992 + 5 * 807_936
    assert fits.largest_depth(GPT2_UNTIED, 2, budget, 1, "ddp", checkpointing=True).n_layer == 5
    assert fits.largest_depth(GPT2_UNTIED, 2, budget, 1, "ddp").n_layer == 4  # (budget − 329,728) / 939,008 = 4.45


# ---------------------------------------------------------------- plan CLI


def test_plan_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["time", "--params", "70e9", "--tokens", "15e12", "--gpu", "H100", "--n-gpus", "1024",
                 "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    # 6.3e24 FLOPs; 12,441,544 s; GPU-hours 1024 · 12,441,544 / 3600 = 3,538,928; 144.0 days.
    for key in ("6.300e+24 FLOPs", "3,538,928", "144.0 days", "989 TFLOP/s"):
        assert key in out


def test_plan_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--gpu", "H100", "--n-gpus", "8", "--usable", "1"]) == 0
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in capsys.readouterr().out.splitlines()}
    # 80e9 / 16, / 5.5, / 3.75, / 2 parameters; a ring on 8 ranks sends 2·7/8 = 1.75Ψ (3·7/8 for zero3)
    assert rows[("ddp", "fp32")] == ["16", "1.75Ψ", "5.00", "B"]
    assert rows[("zero1", "mixed")] == ["5.5", "1.75Ψ", "14.55", "B"]
    assert rows[("zero2", "mixed")] == ["3.75", "1.75Ψ", "21.33", "B"]
    assert rows[("zero3", "mixed")] == ["2", "2.625Ψ", "40.00", "B"]


def test_plan_memory_with_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["memory", "--gpu", "H100", "--n-gpus", "8", "--micro-batch", "8", "--seq-len", "2048",
            "--d-model", "8192", "--n-head", "64", "--vocab", "50257", "--usable", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 2048·8·8192·34 = 4.56e9 bytes per layer; 4·8·2048·50257 = 3.29e9 bytes of logits.
    assert "4.56 GB per layer + 3.29 GB (logits)" in out
    zero3 = next(line for line in out.splitlines() if line.startswith("zero3     mixed")).split()
    expected = fits.largest_depth(ModelConfig(n_layer=1, n_head=64, d_model=8192, block_size=2048, vocab_size=50257),
                                 8, 80e9, 8, "zero3")
    # 12 layers: 12·(2 B·805.4M + 4.56e9) + 2 B·428.5M + 3.29e9 = 78.2e9 bytes; 13 layers: 84.4e9 > 80e9.
    assert zero3[-4] == str(expected.n_layer) == "12"
    assert main([*argv, "--checkpointing"]) == 0
    assert "per layer" in capsys.readouterr().out


def _mesh_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith("tp ")]


def test_plan_mesh_prices_every_tp_pp_dp_layout_and_chooses_the_fastest_that_fits(capsys: pytest.CaptureFixture[str]
                                                                                 ) -> None:
    argv = ["mesh", "--preset", "gpt2-350m", "--n-gpus", "16", "--memory-gb", "3", "--show", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _mesh_rows(out)
    # tp 1, 2, 4, 8 within a node; pp each divisor of the 24 layers that divides 16 / tp: 4 + 4 + 3 + 2 pairs
    assert len(rows) == 13 * 4 and {(r[1], r[4]) for r in rows} >= {("1", "8"), ("8", "2")}
    by = {(r[1], r[4], r[8]): r for r in rows}
    # 354.8M params, 16 B each under ddp: 5.68 GB of states, more than 0.9 × 3 GB
    assert by["1", "1", "ddp"][10:12] == ["5.68", "GB"] and by["1", "1", "ddp"][16] == "no"
    # two stages: each holds half the blocks and its own copy of the tied embedding (51.5M of 354.8M)
    counts = acc.param_counts(resolve({"model": {"preset": "gpt2-350m"}}).model)
    half = counts.non_embedding / 2 + counts.embedding
    assert by["1", "2", "ddp"][10] == f"{16 * half / 1e9:.2f}"
    for r in rows:  # the bubble is (p − 1)/m of the compute; the step the sum of its terms
        compute, bubble, *rest, step = map(float, r[17:])
        assert bubble == pytest.approx(compute * (int(r[4]) - 1) / int(r[9]), abs=2e-3)
        assert step == pytest.approx(compute + bubble + sum(rest), abs=3e-3)
    best = min((float(r[-1]), int(r[1]), int(r[4]), r) for r in rows if r[16] == "yes")[-1]
    assert f"choice: tp {best[1]} × pp {best[4]} × dp {best[7]}, {best[8]}" in out
    assert main(["mesh", "--preset", "gpt2-350m", "--n-gpus", "2", "--memory-gb", "0.2"]) == 2
    assert capsys.readouterr().err.startswith("error: no layout of 2 × H100 holds gpt2-350m")
    assert main(["mesh", "--preset", "gpt9"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown model preset 'gpt9'")
    assert main(["mesh", "--preset", "gpt2-350m", "--compare", "8by2"]) == 2
    assert capsys.readouterr().err.startswith("error: argument --compare: expected TPxPP such as 8x16")


def test_plan_mesh_for_70b_on_1024_h100s_prices_the_published_tp8_pp16_beside_its_choice(capsys):
    """CS336's 70B on 1024 H100s: Llama 3 70B's shape; tp 8 × pp 16 is Llama 3 405B's published layout."""
    assert main(["mesh", "--preset", "llama3-70b", "--n-gpus", "1024", "--compare", "8x16", "--show", "0"]) == 0
    out = capsys.readouterr().out
    rows = _mesh_rows(out)
    assert all(int(r[1]) * int(r[4]) * int(r[7]) == 1024 and 80 % int(r[4]) == 0 for r in rows)
    compared = out.split("compared: ")[1]
    # 4,194,304 tokens per step over dp 8 in micro-batches of 1 × 8192: m = 64, a bubble of 15/64
    assert compared.startswith("tp 8 × pp 16 × dp 8") and "bubble of (p − 1)/m = 23.4% of the compute" in compared
    choice = out.split("choice: ")[1].split(",")[0]
    assert choice != "tp 8 × pp 16 × dp 8" and float(compared.split(" s per step")[0].split(": ")[-1]) > float(
        out.split("fits, ")[1].split(" s per step")[0])


@pytest.mark.parametrize("critical, steps, tokens", [(1_048_576, 1.25, 5.0), (8_388_608, 3.0, 1.5)])
def test_plan_mesh_says_what_its_batch_costs_against_a_critical_batch(capsys, critical, steps, tokens):
    """4,194,304 tokens per step against B_crit: S = S_min (1 + B_crit / B), E = E_min (1 + B / B_crit)."""
    assert main(["mesh", "--preset", "gpt2-350m", "--n-gpus", "16", "--critical-batch", str(critical)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    ratio = 4194304 / critical
    assert line.startswith(f"critical batch {critical:,} tokens: a step of 4,194,304 is {ratio:.3g} B_crit")
    assert f"takes {steps:.3g} x the fewest steps and {tokens:.3g} x the fewest tokens" in line
    assert ("near-linear" in line) == (critical > 4194304)


def test_plan_mesh_keeps_a_model_that_fits_on_one_gpu_free_of_model_parallelism_without_torch():
    # issue 37: 355M parameters on 16 H100s came out as tp 8 × dp 2, after 7.7 s of importing torch
    code = ("import sys; from lab.commands.resources import main; "
            "main(['mesh', '--preset', 'gpt2-350m', '--n-gpus', '16']); "
            "assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "choice: tp 1 × pp 1 × dp 16, ddp (--strategy ddp): the fastest layout that fits" in proc.stdout
    assert "(72.00 GB usable each" in proc.stdout  # 0.9 of 80 GB, as plan memory assumes


def test_plan_memory_and_mesh_plan_with_the_same_usable_fraction(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--gpu", "H100"]) == 0
    assert "(80.00 GB each, 90% usable)" in capsys.readouterr().out


def test_plan_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["peaks"]) == 0
    out = capsys.readouterr().out
    assert "H100   989" in out and "1979" not in out and "A100   312" in out


@pytest.mark.parametrize("argv", [
    ["time", "--params", "70e9", "--tokens", "15e12", "--gpu", "V100"],
    ["time", "--params", "70e9", "--tokens", "15e12", "--mfu", "0"],
    ["time", "--params", "70e9", "--tokens", "15e12", "--mfu", "1.5"],
    ["time", "--params", "-1", "--tokens", "15e12"],
    ["time", "--params", "70e9", "--tokens", "0"],
    ["time", "--params", "70e9", "--tokens", "15e12", "--n-gpus", "0"],
    ["time", "--params", "nan", "--tokens", "15e12"],
    ["memory", "--n-gpus", "-8"],
    ["memory", "--usable", "1.2"],
    ["memory", "--micro-batch", "8"],
    ["memory", "--micro-batch", "1", "--seq-len", "8", "--d-model", "10", "--n-head", "3"],
    [],
])
def test_plan_bad_input(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1


@pytest.mark.slow
def test_launcher_without_torch() -> None:
    code = "import runpy, sys; sys.argv = ['plan', 'peaks']; runpy.run_path('launch/plan.py', run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "989" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import sys, lab.commands.resources; assert 'torch' not in sys.modules"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
