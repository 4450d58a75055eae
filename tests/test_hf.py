"""Hugging Face folders out and in: transformers loads the lab's runs (GPT-2 and Llama classes, the tokenizer),
their logits agree with the lab's, and an imported folder comes back bit for bit and fine-tunes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab.commands import hf
from lab.runtime import checkpoint
from lab.commands.entry import main as lab_main
from lab.commands.cli import run_config, run_main
from lab.runtime.config import ConfigError, ModelConfig, RunConfig
from lab.data import load_tokenizer
from lab.model import GPT
from pool import run_pooled
from test_checkpoints import train_argv

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# fp32 on the CPU: the two implementations order some sums differently (fused qkv against three matmuls,
# torch's RMSNorm against Llama's), a few ulps of logits of order 1
LOGIT_TOLERANCE = 1e-4
MODERN = ["--model.arch", "modern", "--model.n_kv_head", "1", "--model.tie_embeddings", "false",
          "--model.pad_vocab_to", "64"]


@pytest.fixture(scope="module")
def runs(args, tmp_path_factory) -> dict[str, Path]:
    """Finished tiny runs: gpt2 (tied), modern (GQA, untied, padded vocab), and gpt2 under zero3 on 2 ranks."""
    out = {}
    for name, extra in (("gpt2", []), ("modern", MODERN)):
        out[name] = tmp_path_factory.mktemp(name) / "run"
        assert run_main([*args, *extra, "--train.tokens", "1024", "--run-dir", str(out[name])]) == 0
    out["zero3"] = tmp_path_factory.mktemp("zero3") / "run"
    assert run_pooled(train_argv, 2, [*args, "--strategy", "zero3", "--train.tokens", "1024"], out["zero3"]) == \
        ["completed"] * 2
    return out


def lab_model(run_dir: Path) -> GPT:
    cfg = run_config(run_dir)
    model = GPT(cfg.model)
    model.load_state_dict(checkpoint.load_model(checkpoint.latest(run_dir), dict(
        (n, p.shape) for n, p in model.named_parameters())))
    return model.eval()


@pytest.mark.slow  # trains on 2 ranks
@pytest.mark.parametrize("name, cls", [("gpt2", "GPT2LMHeadModel"), ("modern", "LlamaForCausalLM"),
                                       ("zero3", "GPT2LMHeadModel")])
def test_transformers_loads_the_export_and_its_logits_match(runs, tmp_path, name, cls, capsys):
    run_dir, out = runs[name], tmp_path / "hf"
    assert lab_main(["export", str(run_dir), "--format", "hf", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and "wrote" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == cls
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "The state of the union is strong, and"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == load_tokenizer(run_dir / "tokenizer").encode(text)
    lab = lab_model(run_dir)
    with torch.no_grad():
        ours, theirs = lab(ids), model(ids).logits
    assert theirs.shape == ours.shape  # the padded rows are not exported
    assert (ours - theirs).abs().max().item() < LOGIT_TOLERANCE
    assert ours.abs().max().item() > 0.1  # the comparison is of trained logits, not of zeros
    if name == "modern":
        assert model.config.num_key_value_heads == 1 and not model.config.tie_word_embeddings


@pytest.mark.slow
def test_lab_to_hf_to_lab_is_bit_exact_and_the_import_fine_tunes_under_zero2(runs, args, tmp_path, capsys):
    run_dir, out, back = runs["modern"], tmp_path / "hf", tmp_path / "imported"
    assert lab_main(["export", str(run_dir), "--format", "hf", str(out)]) == 0
    fine_tuning = [*args[args.index("--data.corpus"):], "--train.tokens", "512", "--train.batch_tokens", "256",
                   "--train.micro_batch", "4", "--train.eval_tokens", "512", "--train.checkpoint_every", "0"]
    assert lab_main(["import-hf", str(out), "--run-dir", str(back), *fine_tuning]) == 0
    assert "--resume" in capsys.readouterr().out
    original, imported = lab_model(run_dir).state_dict(), lab_model(back).state_dict()
    vocab = run_config(run_dir).model.vocab_size
    assert original.keys() == imported.keys()
    for k in original:  # the padded rows of the original are the only difference
        rows = slice(0, vocab) if k in ("wte.weight", "lm_head.weight") else slice(None)
        assert torch.equal(original[k][rows], imported[k]), k
    # fine-tune: the imported run resumes from its step-0 checkpoint under another strategy on 2 ranks
    resume = ["--config", str(back / "config.toml"), "--strategy", "zero2", "--resume"]
    assert run_pooled(train_argv, 2, resume, back) == ["completed"] * 2
    assert json.loads((back / "summary.json").read_text())["resumed_from_step"] == 0
    assert checkpoint.read_meta(checkpoint.latest(back))["step"] == 2


def test_architectures_the_lab_cannot_express_are_refused_naming_the_field(tmp_path, capsys):
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    for field, value in (("rope_scaling", {"rope_type": "linear", "factor": 2.0}), ("hidden_act", "gelu"),
                         ("head_dim", 32), ("model_type", "bert")):
        folder = tmp_path / field
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, field: value}))
        assert lab_main(["import-hf", str(folder), "--run-dir", str(tmp_path / f"out-{field}")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{field} = " in err, err
        assert not (tmp_path / f"out-{field}").exists()
    with pytest.raises(ConfigError, match="model.parametrization"):
        hf.check_exportable(ModelConfig(parametrization="mup", vocab_size=64))


@pytest.mark.parametrize("command, module, extra", [
    (["export", "RUN", "--format", "hf", "OUT"], "transformers", "hf"),
    (["import-hf", "RUN", "--run-dir", "OUT"], "safetensors", "hf"),
    (["eval", "RUN", "--tasks", "x"], "lm_eval", "eval")])
def test_a_missing_extra_is_named_in_one_line(tmp_path, capsys, monkeypatch, command, module, extra):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else
                        find_spec(name, *a))
    argv = [str(tmp_path / "run") if a == "RUN" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    assert lab_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"the {extra} extra" in err and "pip install" in err, err
    assert not (tmp_path / "out").exists()


def test_every_exported_file_is_readable_by_others(tmp_path):
    from lab.data.tokenizer import BytesTokenizer

    cfg = RunConfig()
    cfg.model = ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=16, vocab_size=BytesTokenizer().vocab_size)
    BytesTokenizer().save(tmp_path / "run" / "tokenizer")
    hf.export_hf(cfg, GPT(cfg.model).state_dict(), tmp_path / "run", tmp_path / "out")
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


@pytest.mark.slow
def test_the_bytes_tokenizer_exports_as_one_autotokenizer_loads(tmp_path):
    from lab.data.tokenizer import BytesTokenizer

    BytesTokenizer().save(tmp_path / "run")
    hf.write_tokenizer(tmp_path / "run", tmp_path / "hf", block_size=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "naïve café, ünïcode ✓ and\nnewlines"
    assert tokenizer(text).input_ids == list(text.encode("utf-8"))
    assert tokenizer.decode(list(text.encode("utf-8"))) == text
    assert tokenizer.eos_token_id == BytesTokenizer().eot_id


TASK = """task: lab_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def fake_run(folder: Path) -> Path:
    """A run directory as far as `lab eval` reads it before scoring: its config."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(RunConfig().to_dict()))
    return folder


def test_offline_a_task_whose_dataset_is_not_local_is_named_in_one_line_before_any_work(tmp_path, capsys,
                                                                                       monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "remote.yaml").write_text(TASK.format(data="x").replace(
        "dataset_path: json", "dataset_path: lab-tests/no-such-dataset"))
    run_dir = fake_run(tmp_path / "run")
    started = time.perf_counter()
    assert lab_main(["eval", str(run_dir), "--tasks", "lab_tiny_choice", "--include-path",
                     str(tmp_path / "tasks")]) == 2
    assert time.perf_counter() - started < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tasks lab_tiny_choice: its dataset "
                                               "lab-tests/no-such-dataset is not in the datasets cache"), err
    assert "--include-path" in err[0] and "dataset_path: json" in err[0]
    assert not (run_dir / "eval.json").exists()
    (tmp_path / "tasks" / "remote.yaml").write_text(TASK.format(data=tmp_path / "missing.json"))  # local, missing
    assert lab_main(["eval", str(run_dir), "--tasks", "lab_tiny_choice", "--include-path",
                     str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tasks lab_tiny_choice: its json files {'test': ") and (
        "missing.json" in err[0] and "cannot be read" in err[0]), err


@pytest.mark.slow  # a process of its own, which probes the Hub as a user's does
def test_without_network_lab_eval_names_the_dataset_it_cannot_fetch_and_exits_2_within_seconds(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # nothing listens: no network
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lab", "eval", str(run_dir), "--tasks", "hellaswag,arc_easy"],
                          capture_output=True, text=True, env=env, timeout=60)
    elapsed = time.perf_counter() - started
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert err[0].startswith("error: --tasks hellaswag: its dataset Rowan/hellaswag is not in the datasets cache")
    # 3.3-3.5 s on the 2-core dev machine at load 1.5-2 (before: 55 s of retries, then a 62-line traceback, exit
    # 1); the bound leaves room for a loaded machine
    assert elapsed < 10, elapsed


@pytest.mark.slow
def test_the_harness_scores_a_run_offline_and_its_scores_sit_beside_the_summary(runs, tmp_path, capsys,
                                                                                monkeypatch):
    pytest.importorskip("lm_eval")
    from lab.runtime.scores import task_columns

    # a DeepSpeed test earlier in this process leaves RANK/LOCAL_RANK/WORLD_SIZE set (its engine wants them), which
    # would make accelerate, under lm-eval's hf model, start a process group: `lab eval` is a process of its own
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [{"question": "The union is", "choices": [" strong", " purple"], "answer": 0},
            {"question": "Congress shall", "choices": [" the", " zebra"], "answer": 0},
            {"question": "We the", "choices": [" people", " xylophone"], "answer": 0}]
    (tmp_path / "tasks").mkdir()
    (tmp_path / "docs.json").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK.format(data=tmp_path / "docs.json"))
    run_dir = runs["gpt2"]
    command = ["eval", str(run_dir), "--include-path", str(tmp_path / "tasks"), "--batch-size", "2"]
    assert lab_main([*command, "--tasks", "lab_tiny_choice"]) == 0
    scores = json.loads((run_dir / "eval.json").read_text())["tasks"]["lab_tiny_choice"]
    acc = scores["metrics"]["acc"]
    assert acc in (0, 1 / 3, 2 / 3, 1) and scores["step"] == 4
    assert task_columns(run_dir) == {"task_lab_tiny_choice": acc}
    # the same score by hand: the lab's own log-likelihoods of each choice, the higher one chosen
    model, tok = lab_model(run_dir), load_tokenizer(run_dir / "tokenizer")
    right = 0
    for d in docs:
        lls = []
        for choice in d["choices"]:
            context, full = tok.encode(d["question"]), tok.encode(d["question"] + choice)
            with torch.no_grad():
                logp = model(torch.tensor([full[:-1]])).log_softmax(-1)[0]
            lls.append(sum(logp[i - 1, full[i]].item() for i in range(len(context), len(full))))
        right += max(range(2), key=lambda i: lls[i]) == d["answer"]
    assert acc == pytest.approx(right / len(docs))
