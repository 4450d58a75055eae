"""The GPT: shapes, counts that match the accounting formulas, causality, RoPE, init, sampling."""

import math

import pytest
import torch

from lab.measure import accounting
from lab.runtime.config import ConfigError, ModelConfig, resolve
from lab.model import GPT, apply_rope, rope_tables, validate

SHAPES = {
    "gpt2-tied": ModelConfig(arch="gpt2", n_layer=2, n_head=4, d_model=64, block_size=32, vocab_size=300),
    "gpt2-untied-nobias-padded": ModelConfig(arch="gpt2", n_layer=2, n_head=4, d_model=64, block_size=32,
                                             vocab_size=300, tie_embeddings=False, bias=False, pad_vocab_to=64),
    "modern-gqa": ModelConfig(arch="modern", n_layer=3, n_head=4, n_kv_head=2, d_model=64, block_size=32,
                              vocab_size=300),
    "modern-mha-bias-dff": ModelConfig(arch="modern", n_layer=1, n_head=2, d_model=32, d_ff=80, block_size=16,
                                       vocab_size=100, bias=True, tie_embeddings=False),
}


@pytest.mark.slow
def test_gpt2_124m_has_124_439_808_parameters():
    cfg = resolve({"model": {"preset": "gpt2-124m"}}).model
    assert accounting.param_counts(cfg).total == 124_439_808
    assert GPT(cfg).param_counts().total == 124_439_808


@pytest.mark.parametrize("name", SHAPES)
def test_live_parameter_counts_match_accounting(name):
    cfg = SHAPES[name]
    assert GPT(cfg).param_counts() == accounting.param_counts(cfg)


def test_padded_vocabulary_keeps_logits_to_the_real_vocabulary():
    cfg = SHAPES["gpt2-untied-nobias-padded"]
    model = GPT(cfg)
    assert model.wte.weight.shape[0] == 320
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 300)


@pytest.mark.parametrize("name", ["gpt2-tied", "modern-gqa"])
def test_initial_loss_is_near_uniform(name):
    torch.manual_seed(0)
    cfg = SHAPES[name]
    x, y = torch.randint(0, cfg.vocab_size, (2, 4, cfg.block_size))
    loss = GPT(cfg)(x, y).item()
    assert abs(loss - math.log(cfg.vocab_size)) < 0.1


@pytest.mark.parametrize("name", ["gpt2-tied", "modern-gqa"])
def test_attention_is_causal(name):
    torch.manual_seed(0)
    cfg = SHAPES[name]
    model = GPT(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % cfg.vocab_size
    a, b = model(x), model(y)
    assert torch.equal(a[0, :12], b[0, :12])
    assert not torch.allclose(a[0, 12:], b[0, 12:])


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    cos, sin = rope_tables(8, 64, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(m, n):
        qm = apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 64, 8), cos, sin)[0, 0, m]
        kn = apply_rope(k.view(1, 1, 1, 8).expand(1, 1, 64, 8), cos, sin)[0, 0, n]
        return (qm @ kn).item()

    assert score(10, 3) == pytest.approx(score(40, 33), rel=1e-5)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_residual_projections_get_scaled_init():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=8, n_head=4, d_model=256, block_size=16, vocab_size=100)
    model = GPT(cfg)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_tied_embeddings_are_one_parameter():
    model = GPT(SHAPES["gpt2-tied"])
    assert model.lm_head is None and "lm_head.weight" not in dict(model.named_parameters())
    assert GPT(SHAPES["gpt2-untied-nobias-padded"]).lm_head.weight is not None
    x = torch.randint(0, SHAPES["gpt2-tied"].vocab_size, (1, 8))
    model(x, x).backward()  # the table gets gradient from the lookup and from the head
    lookup_only = torch.zeros_like(model.wte.weight).index_add_(0, x[0], torch.ones(8, model.cfg.d_model))
    assert (model.wte.weight.grad.abs().sum(1) > 0).sum() > (lookup_only.abs().sum(1) > 0).sum()


@pytest.mark.parametrize("name", ["gpt2-tied", "modern-gqa", "gpt2-untied-nobias-padded"])
def test_init_depends_only_on_seed_and_name(name):
    """Built directly or on the meta device and filled tensor by tensor: the same weights, per seed."""
    cfg = SHAPES[name]
    a, b = GPT(cfg, seed=5), GPT(cfg, seed=6)
    with torch.device("meta"):
        late = GPT(cfg, seed=5)
    late.to_empty(device="cpu")
    late.init_weights()
    torch.manual_seed(123)  # the global RNG plays no part
    again = GPT(cfg, seed=5)
    for (key, x), y, z, w in zip(a.state_dict().items(), late.state_dict().values(), again.state_dict().values(),
                                 b.state_dict().values()):
        assert torch.equal(x, y) and torch.equal(x, z), key
        if x.std() > 0:
            assert not torch.equal(x, w), key


def test_generate_is_greedy_at_temperature_zero_and_crops_context():
    torch.manual_seed(0)
    cfg = SHAPES["modern-gqa"]
    model = GPT(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 30))
    a = model.generate(prompt, 10, temperature=0)
    b = model.generate(prompt, 10, temperature=0)
    assert a.shape == (2, 40) and torch.equal(a, b) and torch.equal(a[:, :30], prompt)
    g = torch.Generator().manual_seed(1)
    c = model.generate(prompt, 10, temperature=1.0, top_k=1, generator=g)
    assert torch.equal(c, a)  # top-1 sampling is greedy


@pytest.mark.parametrize("changes, message", [
    (dict(n_head=3), "must divide model.d_model"),
    (dict(n_kv_head=3), "must divide model.n_head"),
    (dict(arch="mamba"), "model.arch must be gpt2 or modern"),
    (dict(arch="modern", n_head=64, d_model=64 * 3), "even head dimension"),
    (dict(dropout=1.5), "dropout"),
    (dict(n_layer=0), "model.n_layer must be positive"),
])
def test_invalid_shapes_are_rejected(changes, message):
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, d_model=64, vocab_size=100), **changes})
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
