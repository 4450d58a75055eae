"""Data: input formats, the held-out split, tokenizers, prepared shards, sampling, the command line."""

from __future__ import annotations

import hashlib
import json
import math
import random
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from lab.runtime.config import ConfigError, DataConfig
from lab.data import (
    BatchSampler,
    PreparedData,
    check_source,
    eval_batches,
    load_tokenizer,
    prepare,
    prepare_main,
    shards,
)
from lab.data.corpora import TXT_CHUNK_CHARS, builtin_folder, is_held_out, iter_documents, resolve_source
from lab.data.shards import TokenStream, dtype_for
from lab.data.tokenizer import BytesTokenizer, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "union", "naïve", "café", "日本語", "🙂", "state", "of", "congress", "—", "peace", "tariff"]
TRICKY = "Café — naïve 日本語 🙂\n\ttabs  and <|endoftext|> as plain text\r\n\x00end"


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {i}. " + " ".join(rng.choices(WORDS, k=rng.randint(20, 60))) + "\n" for i in range(n)]


def config(corpus: Path | str, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "cache"), **kw)


def documents_in(stream: TokenStream, tok: Tokenizer) -> list[str]:
    """The documents of a stream, cut at end-of-text (which must close the stream)."""
    tokens = np.concatenate([np.asarray(s) for s in stream.shards]).astype(np.int64)
    assert tokens[-1] == tok.eot_id
    return [tok.decode(part[:-1].tolist()) for part in np.split(tokens, np.flatnonzero(tokens == tok.eot_id) + 1)[:-1]]


# ---------------------------------------------------------------- input formats and the split


def write_corpus(kind: str, folder: Path) -> tuple[Path, list[str]]:
    """A corpus of one kind under ``folder``: (path to give as data.corpus, its expected documents)."""
    folder.mkdir()
    docs = make_docs(12)
    if kind == "folder":
        for i, d in enumerate(docs):
            sub = folder / ("a/b" if i % 2 else "")
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"d{i:02d}.txt").write_text(d, encoding="utf-8")
        (folder / "blank.txt").write_text("  \n")  # skipped: no text
        (folder / "notes.md").write_text("not a corpus file")
        (folder / ".hidden").mkdir()
        (folder / ".hidden" / "x.txt").write_text("hidden files are skipped")
        return folder, docs
    if kind == "jsonl":
        lines = [json.dumps({"text": d, "n": i}) for i, d in enumerate(docs)]
        (folder / "c.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n", encoding="utf-8")
        return folder / "c.jsonl", docs
    if kind == "parquet":
        pd.DataFrame({"n": range(13), "text": docs + [None]}).to_parquet(folder / "c.parquet")
        return folder / "c.parquet", docs
    # one .txt file: paragraphs of 3,001 characters (with their blank line), so every 4 make a document
    rng = random.Random(1)
    paras = [(f"Paragraph {k}. " + " ".join(rng.choices(WORDS, k=800)))[:2999] + "\n\n" for k in range(48)]
    (folder / "big.txt").write_text("".join(paras), encoding="utf-8")
    return folder / "big.txt", ["".join(paras[i:i + 4]) for i in range(0, 48, 4)]


@pytest.mark.parametrize("kind", ["folder", "txt", "jsonl", "parquet"])
def test_each_input_format_round_trips_through_prepare(kind, tmp_path):
    corpus, docs = write_corpus(kind, tmp_path / "src")
    cfg = config(corpus, tmp_path, tokenizer="bytes", eval_fraction=0.5)
    check_source(cfg)
    data = PreparedData.load(prepare(cfg, progress=False))
    train, held = documents_in(data.train, data.tokenizer), documents_in(data.eval, data.tokenizer)
    assert sorted(train + held) == sorted(docs)
    assert train and held  # both splits got whole documents
    ids = [d.id for d in iter_documents(resolve_source(str(corpus), "text"))]
    assert data.meta["eval_ids"] == [i for i in ids if is_held_out(i, 0.5)]
    assert data.meta["documents"] == {"train": len(train), "eval": len(held)}


def test_single_txt_file_is_cut_at_blank_lines_into_documents(tmp_path):
    corpus, docs = write_corpus("txt", tmp_path / "src")
    got = list(iter_documents(resolve_source(str(corpus), "text")))
    assert [d.text for d in got] == docs and all(len(d.text) >= TXT_CHUNK_CHARS for d in got)
    assert [d.id for d in got] == [f"big.txt:{1 + 8 * k}" for k in range(12)]  # first line of each


def test_a_small_single_txt_file_is_a_corpus(tmp_path):
    """A few kilobytes in one file: cut finer than TXT_CHUNK_CHARS so some of it can be held out."""
    rng = random.Random(2)
    text = "".join(" ".join(rng.choices(WORDS, k=60)) + "\n\n" for _ in range(20))  # about 7 KB
    (tmp_path / "notes.txt").write_text(text, encoding="utf-8")
    data = PreparedData.load(prepare(config(tmp_path / "notes.txt", tmp_path, tokenizer="bytes"), progress=False))
    docs = data.meta["documents"]
    assert docs["eval"] >= 1 and docs["train"] >= 5
    assert "".join(documents_in(data.train, data.tokenizer) + documents_in(data.eval, data.tokenizer)) != ""


def test_a_corpus_whose_hashes_miss_the_fraction_still_holds_one_document_out(tmp_path):
    corpus = tmp_path / "src"
    corpus.mkdir()
    names = [f"d{i}.txt" for i in range(40) if not is_held_out(f"d{i}.txt", 0.05)][:6]
    for name in names:
        (corpus / name).write_text(f"document {name} " * 20)
    data = PreparedData.load(prepare(config(corpus, tmp_path, tokenizer="bytes"), progress=False))
    lowest = min(names, key=lambda n: int.from_bytes(hashlib.sha1(n.encode()).digest()[:8], "big"))
    assert data.meta["eval_ids"] == [lowest] and data.meta["documents"] == {"train": 5, "eval": 1}


def test_folder_ids_are_relative_paths_in_sorted_order(tmp_path):
    corpus, _ = write_corpus("folder", tmp_path / "src")
    ids = [d.id for d in iter_documents(resolve_source(str(corpus), "text"))]
    assert ids == sorted(ids) and "a/b/d01.txt" in ids and "d00.txt" in ids
    assert not any("hidden" in i or "blank" in i for i in ids)


def test_split_is_by_document_hash_stable_and_near_the_fraction():
    ids = [f"doc-{i}.txt" for i in range(4000)]
    held = [i for i in ids if is_held_out(i, 0.1)]
    assert 0.085 < len(held) / len(ids) < 0.115
    assert held == [i for i in ids if is_held_out(i, 0.1)]  # deterministic
    assert set(held) <= {i for i in ids if is_held_out(i, 0.2)}  # a larger fraction only adds documents


# ---------------------------------------------------------------- tokenizers


def test_bpe_tokenizer_round_trips_and_saves(tiny_prepared, tmp_path):
    tok = load_tokenizer(tiny_prepared / "tokenizer")
    assert tok.kind == "bpe" and tok.vocab_size == 512 and 0 <= tok.eot_id < 512
    ids = tok.encode(TRICKY)
    assert tok.decode(ids) == TRICKY and tok.eot_id not in ids  # the literal marker is just text
    assert len(ids) < len(TRICKY.encode())  # merges learned
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    assert tok.encode_batch(["State of the Union", TRICKY]) == [tok.encode("State of the Union"), ids]
    tok.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").encode(TRICKY) == ids


def test_bytes_tokenizer_round_trips_and_saves(tmp_path):
    tok = BytesTokenizer()
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    ids = tok.encode(TRICKY)
    assert ids == list(TRICKY.encode()) and tok.decode(ids) == TRICKY
    assert tok.decode(ids + [256] + ids) == TRICKY + "<|endoftext|>" + TRICKY
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # cut UTF-8 is replaced, not an error
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), BytesTokenizer)
    with pytest.raises(ConfigError, match="no tokenizer"):
        load_tokenizer(tmp_path / "nowhere")


def test_bpe_is_trained_on_training_documents_only(tmp_path):
    corpus = tmp_path / "src"
    corpus.mkdir()
    docs = make_docs(16)
    for i, d in enumerate(docs):
        extra = " Zyzzogeton" * 300 if is_held_out(f"d{i:02d}.txt", 0.3) else ""
        (corpus / f"d{i:02d}.txt").write_text(d + extra)
    data = PreparedData.load(prepare(config(corpus, tmp_path, vocab_size=512, eval_fraction=0.3), progress=False))
    assert data.meta["documents"]["eval"] >= 1
    assert len(data.tokenizer.encode(" Zyzzogeton")) >= 5  # never merged: it only occurs in held-out text
    assert len(data.tokenizer.encode(" congress")) <= 2


# ---------------------------------------------------------------- prepared folder


def test_meta_json_describes_the_prepared_folder(tiny_prepared, tiny_corpus):
    meta = json.loads((tiny_prepared / "meta.json").read_text())
    assert tiny_prepared.name.startswith(f"{tiny_corpus.name}-bpe512-") and len(tiny_prepared.name.split("-")[-1]) == 8
    assert (meta["format"], meta["corpus"], meta["tokenizer"]) == (1, str(tiny_corpus), "bpe")
    assert (meta["vocab_size"], meta["dtype"]) == (512, "uint16")
    assert meta["documents"] == {"train": 31, "eval": 1}
    assert meta["eval_ids"] == ["1949-Truman-1.txt"]
    data = PreparedData.load(tiny_prepared)
    assert data.vocab_size == 512 and meta["tokens"] == {"train": len(data.train), "eval": len(data.eval)}
    for split in ("train", "eval"):
        [shard] = meta["shards"][split]
        assert (tiny_prepared / shard["file"]).stat().st_size == 2 * shard["tokens"]
    train = np.asarray(data.train.shards[0]).astype(np.int64)
    assert (train == data.tokenizer.eot_id).sum() == 31 and train[-1] == data.tokenizer.eot_id
    p = np.bincount(train) / len(train)
    assert meta["unigram_entropy_nats"] == pytest.approx(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert 3.5 < meta["unigram_entropy_nats"] < math.log(512)
    assert not data.train.shards[0].flags.writeable  # opened read-only


def test_held_out_documents_are_whole_and_decode_exactly(tiny_prepared, tiny_corpus):
    data = PreparedData.load(tiny_prepared)
    held = documents_in(data.eval, data.tokenizer)
    assert held == [(tiny_corpus / i).read_text(encoding="utf-8") for i in data.meta["eval_ids"]]


def test_uint32_shards_hold_the_same_tokens(tiny_corpus, tmp_path, monkeypatch):
    cfg = config(tiny_corpus, tmp_path / "16", tokenizer="bytes")
    small = PreparedData.load(prepare(cfg, progress=False))
    monkeypatch.setattr(shards, "dtype_for", lambda vocab_size: np.dtype("<u4"))
    wide = PreparedData.load(prepare(replace(cfg, cache_dir=str(tmp_path / "32")), progress=False))
    assert (small.meta["dtype"], wide.meta["dtype"]) == ("uint16", "uint32")
    assert wide.train.shards[0].dtype == np.uint32
    assert np.array_equal(small.train.shards[0], wide.train.shards[0])
    assert (dtype_for(2**16), dtype_for(2**16 + 1)) == (np.uint16, np.uint32)


def test_small_shard_size_gives_several_full_shards(tiny_corpus, tmp_path):
    cfg = config(tiny_corpus, tmp_path, tokenizer="bytes")
    one = PreparedData.load(prepare(cfg, progress=False))
    many = PreparedData.load(prepare(cfg, progress=False, shard_tokens=10_000))
    assert many.folder != one.folder
    sizes = [s["tokens"] for s in many.meta["shards"]["train"]]
    assert len(sizes) == math.ceil(len(one.train) / 10_000) > 5
    assert set(sizes[:-1]) == {10_000} and sum(sizes) == len(one.train)
    assert np.array_equal(np.concatenate(many.train.shards), one.train.shards[0])


def test_prepare_is_idempotent_and_reuses_the_folder(tiny_prepared, tiny_data_config):
    before = {f.name: f.stat().st_mtime_ns for f in tiny_prepared.iterdir()}
    assert prepare(tiny_data_config, progress=False) == tiny_prepared
    assert {f.name: f.stat().st_mtime_ns for f in tiny_prepared.iterdir()} == before
    assert not [p for p in tiny_prepared.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_fingerprint_follows_config_and_source(tiny_corpus, tmp_path):
    corpus = tmp_path / "src"
    corpus.mkdir()
    for i, d in enumerate(make_docs(12)):
        (corpus / f"d{i:02d}.txt").write_text(d)
    cfg = config(corpus, tmp_path, tokenizer="bytes", eval_fraction=0.5)
    first = prepare(cfg, progress=False)
    assert prepare(replace(cfg, eval_fraction=0.4), progress=False) != first
    assert prepare(replace(cfg, vocab_size=999), progress=False) == first  # bytes ignores vocab_size
    (corpus / "d00.txt").write_text("changed text")
    assert prepare(cfg, progress=False) != first


def test_concurrent_prepares_both_return_one_valid_folder(tiny_corpus, tmp_path):
    cfg = config(tiny_corpus, tmp_path, tokenizer="bytes")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(prepare(cfg, progress=False))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [results[0].name]
    assert len(PreparedData.load(results[0]).eval) > 0


def test_interrupted_prepare_leaves_nothing(tiny_corpus, tmp_path, monkeypatch):
    def interrupted(self, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr(BytesTokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(tiny_corpus, tmp_path, tokenizer="bytes"), progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_damaged_folder_is_rebuilt(tiny_corpus, tmp_path):
    cfg = config(tiny_corpus, tmp_path, tokenizer="bytes")
    folder = prepare(cfg, progress=False)
    (folder / "eval_000.bin").unlink()
    assert prepare(cfg, progress=False) == folder
    assert (folder / "eval_000.bin").is_file() and len(list((tmp_path / "cache").iterdir())) == 1


# ---------------------------------------------------------------- sampling


def synthetic_stream() -> TokenStream:
    """Shards whose tokens count up from 0, 1000 and 2000: a window is inside one shard iff it counts up."""
    return TokenStream("train", [np.arange(0, 300, dtype=np.uint16), np.arange(1000, 1100, dtype=np.uint16),
                                 np.arange(2000, 2020, dtype=np.uint16)])


def test_batches_depend_only_on_seed_and_step():
    s = BatchSampler(synthetic_stream(), seq_len=32, seed=7)
    x, y = s.batch(5, 16, 0, 16)
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
    again = BatchSampler(synthetic_stream(), seq_len=32, seed=7).batch(5, 16, 0, 16)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, s.batch(6, 16, 0, 16)[0])
    assert not torch.equal(x, BatchSampler(synthetic_stream(), seq_len=32, seed=8).batch(5, 16, 0, 16)[0])


def test_rank_and_micro_step_slices_compose_the_global_batch():
    s = BatchSampler(synthetic_stream(), seq_len=16, seed=0)
    full_x, full_y = s.batch(3, 16, 0, 16)
    halves = [s.batch(3, 16, 0, 8), s.batch(3, 16, 8, 16)]
    assert torch.equal(torch.cat([h[0] for h in halves]), full_x)
    quarters = [s.batch(3, 16, lo, lo + 2) for lo in range(0, 16, 2)]  # 4 ranks × 2 micro-steps
    assert torch.equal(torch.cat([q[1] for q in quarters]), full_y)


def test_windows_are_shifted_pairs_inside_one_shard_drawn_uniformly():
    s = BatchSampler(synthetic_stream(), seq_len=32, seed=1)
    x, y = s.batch(0, 20_000, 0, 20_000)
    assert torch.equal(y, x + 1)  # targets are the next tokens, and no window crosses a shard
    starts = set(x[:, 0].tolist())
    assert starts == set(range(0, 268)) | set(range(1000, 1068))  # every valid start; the short shard has none
    assert s.n_windows == 336
    assert (x[:, 0] >= 1000).float().mean().item() == pytest.approx(68 / 336, abs=0.02)


def test_sampler_reads_prepared_data(tiny_prepared):
    data = PreparedData.load(tiny_prepared)
    x, y = BatchSampler(data.train, seq_len=64, seed=0).batch(0, 8, 2, 6)
    assert x.shape == (4, 64) and int(x.max()) < data.vocab_size and torch.equal(x[:, 1:], y[:, :-1])


def test_eval_batches_are_fixed_non_overlapping_and_capped():
    stream = synthetic_stream()
    batches = list(eval_batches(stream, seq_len=32, n_tokens=4 * 32, batch_size=3))
    assert [b[0].shape[0] for b in batches] == [3, 1]
    assert torch.cat([b[0] for b in batches])[:, 0].tolist() == [0, 96, 192, 1000]  # spread over the stream
    again = list(eval_batches(stream, seq_len=32, n_tokens=4 * 32, batch_size=3))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True))
    everything = torch.cat([b[0] for b in eval_batches(stream, seq_len=32, n_tokens=10**6, batch_size=5)])
    assert everything[:, 0].tolist() == [32 * k for k in range(9)] + [1000, 1032, 1064]  # 299//32 + 99//32
    assert torch.equal(torch.cat([b[1] for b in eval_batches(stream, 32, 10**6, 5)]), everything + 1)


def test_a_stream_shorter_than_a_window_is_an_error():
    short = TokenStream("eval", [np.arange(40, dtype=np.uint16), np.arange(30, dtype=np.uint16)])
    with pytest.raises(ConfigError, match=r"eval split .* 40 tokens .* seq_len \+ 1 = 65"):
        BatchSampler(short, seq_len=64, seed=0)
    with pytest.raises(ConfigError, match="seq_len"):
        eval_batches(short, seq_len=64, n_tokens=1000, batch_size=4)


# ---------------------------------------------------------------- bad inputs and the command line


def bad_corpus(kind: str, tmp_path: Path) -> tuple[str, dict]:
    """A data.corpus value (and other fields) that cannot be prepared."""
    d = tmp_path / "bad"
    d.mkdir()
    if kind == "no-supported-files":
        (d / "notes.md").write_text("hello")
    elif kind == "jsonl-without-field":
        (d / "c.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    elif kind == "parquet-without-column":
        pd.DataFrame({"body": ["hello"]}).to_parquet(d / "c.parquet")
    elif kind == "invalid-json":
        (d / "c.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    elif kind == "empty":
        (d / "a.txt").write_text("")
        (d / "b.txt").write_text(" \n\n")
    elif kind == "one-document":
        (d / "a.txt").write_text("only one document")
    elif kind == "unsupported-file":
        (d / "c.csv").write_text("text\nhello\n")
        return str(d / "c.csv"), {}
    return str(d), {}


BAD = [  # (what, data fields, expected message, caught by check_source without reading every document)
    ("missing-path", {"corpus": "no/such/dir"}, "corpus path not found: no/such/dir", True),
    ("unknown-builtin", {"corpus": "shakespeare"}, "unknown corpus 'shakespeare'", True),
    ("no-supported-files", {}, "no .txt, .jsonl or .parquet files under", True),
    ("jsonl-without-field", {}, "c.jsonl:1: no 'text' field", True),
    ("parquet-without-column", {}, r"c.parquet: no column 'text' \(columns: body\)", True),
    ("invalid-json", {}, "c.jsonl:2: invalid JSON", False),
    ("unsupported-file", {}, "unsupported corpus file c.csv", True),
    ("empty", {}, "is empty: no document has any text", False),
    ("one-document", {}, "has one document: at least two are needed", False),
    ("tokenizer", {"corpus": "sotu", "tokenizer": "wordpiece"}, "unknown tokenizer 'wordpiece'", True),
    ("vocab-small", {"corpus": "sotu", "vocab_size": 511}, "vocab_size 511 is out of range", True),
    ("vocab-large", {"corpus": "sotu", "vocab_size": 2**32 + 1}, "out of range for BPE", True),
    ("eval-zero", {"corpus": "sotu", "eval_fraction": 0.0}, r"eval_fraction 0.0 must be in \(0, 0.5\]", True),
    ("eval-large", {"corpus": "sotu", "eval_fraction": 0.6}, "eval_fraction 0.6", True),
]


@pytest.mark.parametrize("what, fields, message, fast", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_config_errors(what, fields, message, fast, tmp_path):
    corpus, _ = bad_corpus(what, tmp_path) if "corpus" not in fields else (fields["corpus"], {})
    cfg = config(corpus, tmp_path, **{k: v for k, v in fields.items() if k != "corpus"})
    if fast:
        with pytest.raises(ConfigError, match=message):
            check_source(cfg)
    with pytest.raises(ConfigError, match=message) as e:
        prepare(cfg, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache").exists()  # nothing written


def test_cli_reports_a_bad_corpus_in_one_line_and_writes_nothing(tmp_path, capsys):
    assert prepare_main(["--data.corpus", str(tmp_path / "nope"), "--data.cache_dir", str(tmp_path / "c")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: corpus path not found: {tmp_path / 'nope'}\n"
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_launch_script_exits_2_on_a_bad_option_value(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "prepare.py"), "--data.vocab_size", "100",
                        "--data.cache_dir", str(tmp_path / "c")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["error: data.vocab_size 100 is out of range for BPE (512 to 2**32)"]
    assert list(tmp_path.iterdir()) == []


def test_cli_prepares_and_summarises(tiny_corpus, tmp_path, capsys):
    argv = ["--data.corpus", str(tiny_corpus), "--data.tokenizer", "bytes", "--data.cache_dir", str(tmp_path),
            "--shard-tokens", "50000"]
    assert prepare_main(argv) == 0
    out = capsys.readouterr().out
    [folder] = list(tmp_path.iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    assert str(folder) in out and "train 31  eval 1" in out and "257 (bytes)" in out
    assert f"train {meta['tokens']['train']:,}" in out and len(meta["shards"]["train"]) > 1
    assert f"{meta['unigram_entropy_nats']:.3f} nats/token" in out


# ---------------------------------------------------------------- the real default corpus


@pytest.fixture(scope="module")
def sotu(tmp_path_factory) -> PreparedData:
    cfg = DataConfig(vocab_size=512, cache_dir=str(tmp_path_factory.mktemp("sotu-cache")))
    check_source(cfg)
    return PreparedData.load(prepare(cfg, progress=False))


@pytest.mark.long
@pytest.mark.slow
def test_sotu_holds_out_whole_speeches(sotu):
    speeches = sorted(builtin_folder("sotu").glob("*.txt"))
    assert sotu.meta["corpus"] == "sotu" and sotu.folder.name.startswith("sotu-bpe512-")
    assert sotu.meta["documents"]["train"] + sotu.meta["documents"]["eval"] == len(speeches) == 249
    assert 5 <= sotu.meta["documents"]["eval"] <= 25
    held = documents_in(sotu.eval, sotu.tokenizer)
    assert held == [(builtin_folder("sotu") / i).read_text(encoding="utf-8") for i in sotu.meta["eval_ids"]]


@pytest.mark.long
@pytest.mark.slow
def test_sotu_token_counts_and_unigram_entropy_are_plausible(sotu):
    tokens = sotu.meta["tokens"]
    assert tokens["train"] > 2_000_000 and 0.02 < tokens["eval"] / (tokens["train"] + tokens["eval"]) < 0.15
    assert 4.5 < sotu.meta["unigram_entropy_nats"] < math.log(512)
    assert sotu.tokenizer.decode(sotu.tokenizer.encode(TRICKY)) == TRICKY


def test_preparing_off_a_terminal_shows_each_phase_in_lines(tiny_corpus, tmp_path, monkeypatch, capsys):
    import time as time_module

    clock = iter(range(0, 10**6, 10))  # 10 s pass between two looks at the clock: every update is shown
    monkeypatch.setattr(time_module, "monotonic", lambda: float(next(clock)))
    prepare(config(tiny_corpus, tmp_path, vocab_size=512))
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("training BPE: ") and " docs after " in line for line in err), err
    assert any(line.startswith("tokenizing: ") and " chars after " in line for line in err), err
