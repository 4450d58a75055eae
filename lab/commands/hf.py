"""Hugging Face folders out and in: ``python -m lab export RUN --format hf OUT`` and ``python -m lab import-hf PATH``.

The ``gpt2`` arch is transformers' ``GPT2LMHeadModel`` (its Conv1D layers keep weights as [in, out]: transposed
here), the ``modern`` arch is ``LlamaForCausalLM`` (the lab's fused qkv and gate|up matrices are cut into
q/k/v and gate/up; both rotate the pairs (x_i, x_{i+d/2}), so RoPE needs no permutation). Weights go as
safetensors, the tokenizer as ``tokenizer.json`` with its ``tokenizer_config.json`` (``AutoTokenizer`` loads
it). The vocabulary's padding rows (``model.pad_vocab_to``) are never read and are left out; a gpt2-arch
model without biases gets zero biases. μP models are refused: their logit and attention scales have no
field in either class. Importing writes a run directory whose step-0 checkpoint (zero AdamW moments) a run
resumes under any strategy: fine-tuning with that run's own schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lab.measure import accounting
from lab.runtime import checkpoint
from lab.runtime.config import (ConfigError, ModelConfig, RunConfig, build_parser, config_from_args,
                                print_error)
from lab.data.tokenizer import BPE_FILE, BYTES_FILE, EOT
from lab.runtime.extras import require
from lab.runtime.files import (JSON_MAX_BYTES, check_path, dumps, fsync_folder, fsync_tree, probe_writable,
                               read_plain, refuse_foreign_folder, save_json, swap_folders, write_atomic)
from lab.model import GPT
from lab.model.gpt import validate
from lab.training.lifecycle import RUN_LOCK, lock_run_dir

WEIGHTS = "model.safetensors"
EXPORT_MARKER = ".lab-export"  # in every folder the HF export writes: the only kind of folder it replaces
INDEX = "model.safetensors.index.json"
TOP = {"gpt2": {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
                "norm_f.weight": "transformer.ln_f.weight", "norm_f.bias": "transformer.ln_f.bias",
                "lm_head.weight": "lm_head.weight"},
       "modern": {"wte.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight",
                  "lm_head.weight": "lm_head.weight"}}
BLOCK_PREFIX = {"gpt2": "transformer.h", "modern": "model.layers"}
# HF buffers some GPT-2 files carry (causal masks); not weights
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _block_layout(cfg: ModelConfig) -> dict[str, tuple[list[str], list[int] | None, bool]]:
    """Lab name inside block i → (HF names inside layer i, row split sizes or None, transposed)."""
    if cfg.arch == "gpt2":
        out = {}
        for lab, hf, t in (("norm1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                           ("attn.proj", "attn.c_proj", True), ("norm2", "ln_2", False),
                           ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True)):
            out[f"{lab}.weight"] = ([f"{hf}.weight"], None, t)
            out[f"{lab}.bias"] = ([f"{hf}.bias"], None, False)
        return out
    hd, ff = accounting.head_dim(cfg), accounting.ffn_width(cfg)
    qkv = [cfg.n_head * hd, accounting.kv_heads(cfg) * hd, accounting.kv_heads(cfg) * hd]
    attn = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    out = {"norm1.weight": (["input_layernorm.weight"], None, False),
           "norm2.weight": (["post_attention_layernorm.weight"], None, False)}
    for kind in ("weight", "bias") if accounting.uses_bias(cfg) else ("weight",):
        out[f"attn.qkv.{kind}"] = ([f"{n}.{kind}" for n in attn], qkv, False)
        out[f"attn.proj.{kind}"] = ([f"self_attn.o_proj.{kind}"], None, False)
        out[f"mlp.up.{kind}"] = ([f"mlp.gate_proj.{kind}", f"mlp.up_proj.{kind}"], [ff, ff], False)
        out[f"mlp.down.{kind}"] = ([f"mlp.down_proj.{kind}"], None, False)
    return out


def _layout(cfg: ModelConfig) -> dict[str, tuple[list[str], list[int] | None, bool]]:
    """Every lab parameter of ``cfg``'s model → its HF tensors (see ``_block_layout``)."""
    out = {lab: ([hf], None, False) for lab, hf in TOP[cfg.arch].items()}
    for i in range(cfg.n_layer):
        for lab, (hfs, split, t) in _block_layout(cfg).items():
            out[f"blocks.{i}.{lab}"] = ([f"{BLOCK_PREFIX[cfg.arch]}.{i}.{n}" for n in hfs], split, t)
    return out


def check_exportable(cfg: ModelConfig) -> None:
    """ConfigError naming the field a Hugging Face class cannot express."""
    if cfg.parametrization != "standard":
        raise ConfigError("model.parametrization mup has no Hugging Face equivalent (its logit and attention "
                          "scales); only standard models export")
    if cfg.moe_experts:
        raise ConfigError(f"model.moe_experts ({cfg.moe_experts}): the Hugging Face export writes GPT-2 and Llama, "
                          "which have no mixture of experts; only dense models export")
    if cfg.arch == "gpt2" and accounting.kv_heads(cfg) != cfg.n_head:
        raise ConfigError(f"model.n_kv_head ({cfg.n_kv_head}): GPT-2 has no grouped-query attention; "
                          "only the modern arch (Llama) exports with it")


def to_hf(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The lab's weights (``GPT.state_dict()`` names) as the HF model's state dict (tied heads left out)."""
    check_exportable(cfg)
    out = {}
    for lab, (hfs, split, transposed) in _layout(cfg).items():
        if lab not in weights:
            if lab.endswith(".bias") and cfg.arch == "gpt2":  # a bias-free gpt2: HF's biases are zero
                out[hfs[0]] = torch.zeros(_bias_size(cfg, lab))
            continue
        t = weights[lab]
        if lab in ("wte.weight", "lm_head.weight"):
            t = t[: cfg.vocab_size]
        parts = t.split(split) if split else [t]
        out |= {name: (p.T if transposed else p).contiguous() for name, p in zip(hfs, parts)}
    return out


def _bias_size(cfg: ModelConfig, lab: str) -> int:
    sizes = {"attn.qkv": 3 * cfg.d_model, "mlp.up": accounting.ffn_width(cfg)}
    return next((n for key, n in sizes.items() if f".{key}." in lab), cfg.d_model)


def from_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The lab's weights from an HF state dict of ``cfg``'s shape; ConfigError naming a missing or extra tensor."""
    used, out = set(), {}
    shapes = _shapes(cfg)
    for lab, (hfs, _, transposed) in _layout(cfg).items():
        if lab not in shapes:
            continue
        missing = [n for n in hfs if n not in tensors]
        if missing:
            raise ConfigError(f"{where}: no tensor {missing[0]}")
        used |= set(hfs)
        t = torch.cat([tensors[n] for n in hfs]) if len(hfs) > 1 else tensors[hfs[0]]
        t = (t.T if transposed else t).to(torch.float32).contiguous()
        if t.shape != shapes[lab]:
            raise ConfigError(f"{where}: {hfs[0]} has shape {list(t.shape)}, the config implies {list(shapes[lab])}")
        out[lab] = t
    extra = sorted(n for n in tensors if n not in used and not n.endswith(IGNORED_SUFFIXES)
                   and not (n == "lm_head.weight" and cfg.tie_embeddings))
    if extra:
        raise ConfigError(f"{where}: tensor {extra[0]} has no place in the lab's model")
    return out


def _shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: p.shape for name, p in GPT(cfg).named_parameters()}


# ---------------------------------------------------------------- configs


def hf_config(cfg: ModelConfig, eot_id: int):  # -> transformers.PretrainedConfig
    """The transformers config of ``cfg``'s model (GPT2Config or LlamaConfig)."""
    transformers = require("transformers", "export --format hf")
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=eot_id,
                  eos_token_id=eot_id, torch_dtype="float32")
    if cfg.arch == "gpt2":
        return transformers.GPT2Config(
            n_positions=cfg.block_size, n_embd=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_inner=accounting.ffn_width(cfg), activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            architectures=["GPT2LMHeadModel"], **common)
    bias = accounting.uses_bias(cfg)
    return transformers.LlamaConfig(
        hidden_size=cfg.d_model, intermediate_size=accounting.ffn_width(cfg), num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=accounting.kv_heads(cfg),
        head_dim=accounting.head_dim(cfg), hidden_act="silu", max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_bias=bias,
        mlp_bias=bias, attention_dropout=cfg.dropout, architectures=["LlamaForCausalLM"], **common)


def _refuse(where: str, field: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"{where}: {field} = {json.dumps(value)} cannot be expressed by the lab's model ({why})")


def _numbers(hf: dict, where: str) -> None:
    """ConfigError (one line) when a size of the config is not a whole number or a scale not a finite number."""
    for field, value in hf.items():
        whole = field in HF_SIZES
        if value is None or (field not in HF_SIZES and field not in HF_SCALES):
            continue
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or \
                (not whole and not float("-inf") < value < float("inf")) or (whole and value < 1):
            raise ConfigError(f"{where}: {field} = {json.dumps(value)[:40]} must be a "
                              f"{'positive whole number' if whole else 'finite number'}")


HF_SIZES = ("vocab_size", "n_layer", "n_head", "n_embd", "n_inner", "n_positions", "hidden_size",
            "num_attention_heads", "num_key_value_heads", "intermediate_size", "num_hidden_layers",
            "max_position_embeddings", "head_dim")
HF_SCALES = ("layer_norm_epsilon", "rms_norm_eps", "rope_theta")


def model_config(hf: object, where: str) -> ModelConfig:
    """The lab's ModelConfig of an HF ``config.json`` (GPT-2 or Llama), its shape checked (``validate``);
    ConfigError naming the field it cannot take."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where} is not a model's config (a JSON object)")
    _numbers(hf, where)
    kind = hf.get("model_type")
    required = {"gpt2": ("vocab_size",), "llama": ("vocab_size", "hidden_size", "num_attention_heads",
                                                    "num_hidden_layers", "intermediate_size")}
    if not isinstance(kind, str) or kind not in required:
        raise _refuse(where, "model_type", kind, "gpt2 and llama are the two it reads")
    if missing := [field for field in required[kind] if hf.get(field) is None]:
        raise ConfigError(f"{where}: no {missing[0]} (a {kind} config needs it)")
    try:
        model = _model_config(hf, where, kind)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:  # a field of another type than HF's
        raise ConfigError(f"{where}: not a {kind} config the lab reads ({' '.join(str(e).split())[:160]})") from None
    validate(model)
    return model


def _model_config(hf: dict, where: str, kind: object) -> ModelConfig:
    common = dict(vocab_size=hf["vocab_size"], pad_vocab_to=1, parametrization="standard")
    if kind == "gpt2":
        for field, ok, why in (
                ("activation_function", hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                 "its MLP uses tanh-approximated GELU"),
                ("scale_attn_weights", hf.get("scale_attn_weights", True), "attention is scaled by 1/sqrt(head_dim)"),
                ("scale_attn_by_inverse_layer_idx", not hf.get("scale_attn_by_inverse_layer_idx", False),
                 "no per-layer attention scale"),
                ("add_cross_attention", not hf.get("add_cross_attention", False), "decoder only")):
            if not ok:
                raise _refuse(where, field, hf.get(field), why)
        d = hf.get("n_embd", 768)
        return ModelConfig(arch="gpt2", n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), d_model=d,
                           d_ff=hf.get("n_inner") or 4 * d, block_size=hf.get("n_positions", 1024), bias=True,
                           tie_embeddings=hf.get("tie_word_embeddings", True),
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5), **common)
    if kind == "llama":
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        bias = hf.get("attention_bias", False)
        for field, ok, why in (
                ("hidden_act", hf.get("hidden_act", "silu") == "silu", "its MLP is SwiGLU"),
                ("rope_scaling", scaling is None, "plain RoPE only"),
                ("head_dim", hf.get("head_dim") in (None, d // heads), "head_dim = hidden_size / num_attention_heads"),
                ("mlp_bias", hf.get("mlp_bias", False) == bias, "one bias setting for attention and MLP"),
                ("pretraining_tp", hf.get("pretraining_tp", 1) == 1, "no tensor-parallel slicing of the head")):
            if not ok:
                raise _refuse(where, field, hf.get(field, scaling), why)
        return ModelConfig(arch="modern", n_layer=hf["num_hidden_layers"], n_head=heads,
                           n_kv_head=hf.get("num_key_value_heads") or heads, d_model=d, d_ff=hf["intermediate_size"],
                           block_size=hf.get("max_position_embeddings", 2048), bias=bias,
                           tie_embeddings=hf.get("tie_word_embeddings", False), norm_eps=hf.get("rms_norm_eps", 1e-6),
                           rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), **common)
    raise _refuse(where, "model_type", kind, "gpt2 and llama are the two it reads")


# ---------------------------------------------------------------- the tokenizer


def _bytes_tokenizer():  # -> tokenizers.Tokenizer
    """The lab's bytes tokenizer as a byte-level BPE without merges: byte b is id b, end-of-text 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte → character table
    chars, extra = {}, 0
    for b in range(256):
        chars[b] = chr(b) if b in printable else chr(256 + extra)
        extra += b not in printable
    tok = Tokenizer(models.BPE({c: b for b, c in chars.items()} | {EOT: 256}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def write_tokenizer(run_tokenizer: Path, out: Path, block_size: int) -> None:
    """The run's tokenizer as ``PreTrainedTokenizerFast`` files (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer

    transformers = require("transformers", "export --format hf")
    if (run_tokenizer / BPE_FILE).is_file():
        tok = Tokenizer.from_file(str(run_tokenizer / BPE_FILE))
    elif (run_tokenizer / BYTES_FILE).is_file():
        tok = _bytes_tokenizer()
    else:
        raise ConfigError(f"no tokenizer in {run_tokenizer}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT,
                                                model_max_length=block_size)
    fast.save_pretrained(str(out))


# ---------------------------------------------------------------- export


def export_hf(cfg: RunConfig, weights: dict[str, torch.Tensor], run_dir: Path, out: Path) -> None:
    """Write ``out``: config.json, model.safetensors, the tokenizer (written beside, then renamed into place)."""
    from lab.data import load_tokenizer

    safetensors = require("safetensors.torch", "export --format hf")
    check_exportable(cfg.model)
    eot = load_tokenizer(run_dir / "tokenizer").eot_id
    config = hf_config(cfg.model, eot)
    check_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror or e})") from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the export from other users
        config.save_pretrained(str(tmp))
        safetensors.save_file(to_hf(cfg.model, weights), str(tmp / WEIGHTS), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS, 0o644)  # safetensors writes 0600; readable by others as every file the lab writes
        write_tokenizer(run_dir / "tokenizer", tmp, cfg.model.block_size)
        (tmp / EXPORT_MARKER).write_text(dumps({"run_dir": str(run_dir.absolute())}) + "\n")
        fsync_tree(tmp)
        swap_folders(tmp, out)  # an earlier export in out (check_out) is swapped into tmp, removed below
        fsync_folder(out.parent)
    except OSError as e:
        raise ConfigError(f"--out {out} could not be written ({e.strerror or e}); an earlier export there is "
                          f"untouched") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_out(out: Path) -> None:
    """ConfigError (one line) unless ``out`` can take an HF export: a new or empty folder, or an earlier export
    (it holds EXPORT_MARKER), never a folder of the user's, which the export would replace."""
    check_path(out, "--out")
    refuse_foreign_folder(out, (EXPORT_MARKER,), "--out")


# ---------------------------------------------------------------- import


def read_config(path: Path) -> object:
    """An HF folder's config.json."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face model folder (no config.json)")
    return read_import_json(path / "config.json")


def read_import_json(file: Path) -> object:
    """A JSON file of an HF folder, read bounded and only as a plain file (a link is followed: the HF cache links
    its snapshots to blobs); ConfigError (one line) otherwise."""
    try:
        return json.loads(read_plain(file, JSON_MAX_BYTES).decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"{file} is unreadable (nested too deeply)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file} is unreadable ({' '.join(str(e).split())[:200]})") from None


def _shard_names(path: Path) -> list[str]:
    """The weight files a sharded index names, each a plain file directly in ``path``; ConfigError otherwise."""
    index = read_import_json(path / INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{path / INDEX}: no weight_map of tensor names to file names")
    for name in set(weight_map.values()):
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name or "\0" in name:
            raise ConfigError(f"{path / INDEX}: weight_map names the file {name!r}, which is not a file of the "
                              f"folder")
        if not (path / name).is_file():
            raise ConfigError(f"{path / INDEX}: weight_map names {name}, which is not a plain file in {path}")
    return sorted(set(weight_map.values()))


def read_tensors(path: Path, model_type: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder with one safetensors file or a sharded index (GPT-2 names with their prefix)."""
    safetensors = require("safetensors.torch", "import-hf")
    if (path / INDEX).is_file():
        files = _shard_names(path)
    elif (path / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise ConfigError(f"{path}: no {WEIGHTS} or {INDEX} (only safetensors weights are read)")
    tensors = {}
    for name in files:
        try:
            tensors |= safetensors.load_file(str(path / name))
        except Exception as e:  # safetensors' own error type for a torn or crafted file, OSError, ValueError
            raise ConfigError(f"{path / name} is unreadable ({' '.join(str(e).split())[:200]})") from None
    if model_type == "gpt2" and not any(k.startswith("transformer.") for k in tensors):
        tensors = {k if k == "lm_head.weight" else f"transformer.{k}": v for k, v in tensors.items()}
    return tensors


def _toml_value(v: object) -> str:
    return json.dumps(v) if isinstance(v, (str, bool)) else repr(v)


def to_toml(tree: dict) -> str:
    """A config tree (sections of scalars) as TOML; None values are left out (every optional field's default)."""
    lines = []
    for section, values in tree.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def write_imported(cfg: RunConfig, weights: dict[str, torch.Tensor], tokenizer_json: str | None,
                   run_dir: Path) -> Path:
    """A run directory holding ``weights`` as its step-0 checkpoint (zero AdamW moments), its config (JSON and
    TOML) and the tokenizer; returns the checkpoint folder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        state[f"model/{name}"] = w.reshape(-1)
        state[f"optim/{name}/exp_avg"] = torch.zeros(w.numel())
        state[f"optim/{name}/exp_avg_sq"] = torch.zeros(w.numel())
        state[f"optim/{name}/step"] = torch.zeros((), dtype=torch.float32)
    folder = checkpoint.save(run_dir, 0, 0, 1, state, {"tokens": 0, "wall_time_s": 0.0, "strategy": "import-hf"},
                             keep=0)
    save_json(run_dir / "config.json", cfg.to_dict())
    write_atomic(run_dir / "config.toml", to_toml(cfg.to_dict()))
    if tokenizer_json is not None:
        (run_dir / "tokenizer").mkdir(exist_ok=True)
        write_atomic(run_dir / "tokenizer" / BPE_FILE, tokenizer_json)
    return folder


def _refuse_a_run(run_dir: Path) -> None:
    if checkpoint.latest(run_dir) is not None or (run_dir / "config.json").exists():
        raise ConfigError(f"{run_dir} already holds a run; choose another --run-dir")


def _bpe_tokenizer(file: Path) -> str | None:
    """The text of an HF folder's tokenizer.json when it is a BPE with the lab's end-of-text token (else None: the
    run's own tokenizer is then used), read bounded (``read_import_json``)."""
    doc = read_import_json(file) if file.exists() or file.is_symlink() else None
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    return json.dumps(doc, ensure_ascii=False) if isinstance(vocab, dict) and EOT in vocab else None


def import_main(argv: list[str] | None = None, prog: str = "python -m lab import-hf") -> int:
    """Turn a local transformers GPT-2 or Llama folder into a run directory that a run resumes (fine-tunes)."""
    p = build_parser(prog, "Turn a Hugging Face GPT-2 or Llama folder (config.json + safetensors) into a run "
                           "directory whose step-0 checkpoint a run resumes: fine-tuning under any strategy. The "
                           "[data], [train] and [parallel] options are the fine-tuning run's; [model] comes from "
                           "the folder.")
    p.add_argument("path", help="the Hugging Face model folder")
    args = p.parse_args(argv)
    try:
        require("safetensors", "import-hf")
        given = sorted(k for k in vars(args) if k.startswith("model."))
        if given:
            raise ConfigError(f"--{given[0]}: the model comes from {args.path}/config.json")
        if not args.run_dir:
            raise ConfigError("--run-dir is required: the run directory to write")
        run_dir, path = check_path(args.run_dir, "--run-dir"), Path(args.path)
        probe_writable(run_dir, "--run-dir")
        refuse_foreign_folder(run_dir, (RUN_LOCK, "checkpoints"), "--run-dir")
        _refuse_a_run(run_dir)
        hf = read_config(path)
        model = model_config(hf, str(path / "config.json"))
        tokenizer = _bpe_tokenizer(path / "tokenizer.json")
        weights = from_hf(model, read_tensors(path, hf["model_type"]), str(path))
        cfg = config_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "path"}))
        cfg.model = model
        with lock_run_dir(run_dir):  # no run writes the folder meanwhile
            _refuse_a_run(run_dir)
            folder = write_imported(cfg, weights, tokenizer, run_dir)
    except ConfigError as e:
        print_error(str(e))
        return 2
    except OSError as e:  # a full disk or quota (a checkpoint's own error names what is kept)
        print_error(f"{run_dir} could not be written ({e.strerror or e}); remove it and import again")
        return 1
    n = sum(w.numel() for w in weights.values())
    print(f"wrote {folder}: {n:,} parameters ({model.arch}, {model.n_layer} layers, d_model {model.d_model})")
    print(f"fine-tune it: python -m lab train --config {run_dir / 'config.toml'} --run-dir {run_dir} --resume")
    return 0

