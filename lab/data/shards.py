"""Prepare a corpus once (split, train the tokenizer, tokenize into memmap shards) and read it back.

A prepared folder ``<cache_dir>/<corpus>-<tokenizer><vocab>-<fingerprint>`` holds:

- ``meta.json``: format, corpus, tokenizer, vocab_size, dtype, shards with token counts, document
  and token counts per split, the held-out document ids, the train unigram entropy;
- ``tokenizer/``: ``tokenizer.json`` (BPE) or ``bytes_tokenizer.json``, for ``load_tokenizer``;
- ``train_000.bin``, ``eval_000.bin``, …: raw little-endian uint16 (vocab ≤ 65,536) or uint32
  tokens, every document followed by end-of-text; every shard but the last of a split is full.

The folder is built in a temporary folder beside it and renamed into place, so it is either
complete or absent; when two processes race, the first rename wins and both return it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lab.runtime.config import ConfigError, DataConfig, did_you_mean
from lab.data.corpora import Document, Source, check_files, id_fraction, is_held_out, iter_documents, resolve_source
from lab.data.tokenizer import (
    BPE_FILE,
    BYTES_FILE,
    KINDS,
    BPETokenizer,
    BytesTokenizer,
    Tokenizer,
    load_tokenizer,
)
from lab.runtime.progress import Lines, progress as progress_of
from lab.runtime.files import fsync_folder, fsync_tree, probe_writable, process_alive, write_atomic

FORMAT = 1
META = "meta.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "eval")
DEFAULT_SHARD_TOKENS = 50_000_000
MIN_BPE_VOCAB = 512
MAX_VOCAB = 2**32
_BATCH_CHARS = 1_000_000  # text encoded per encode_batch call


def check_source(cfg: DataConfig) -> None:
    """Validate a data config without tokenizing: ConfigError with a one-line message if it cannot work.

    When the corpus still has to be prepared, ``data.cache_dir`` must be writable.
    """
    source = _resolve(cfg)
    if not is_prepared(_folder(cfg, source, DEFAULT_SHARD_TOKENS)):
        probe_writable(Path(cfg.cache_dir).expanduser(), "data.cache_dir")


def _resolve(cfg: DataConfig) -> Source:
    if cfg.tokenizer not in KINDS:
        raise ConfigError(f"unknown tokenizer '{cfg.tokenizer}' (data.tokenizer: {' or '.join(KINDS)})"
                          f"{did_you_mean(cfg.tokenizer, KINDS)}")
    if cfg.tokenizer == "bpe" and not MIN_BPE_VOCAB <= cfg.vocab_size <= MAX_VOCAB:
        raise ConfigError(f"data.vocab_size {cfg.vocab_size} is out of range for BPE "
                          f"({MIN_BPE_VOCAB} to 2**32)")
    if not 0.0 < cfg.eval_fraction <= 0.5:
        raise ConfigError(f"data.eval_fraction {cfg.eval_fraction} must be in (0, 0.5]")
    source = resolve_source(cfg.corpus, cfg.text_field)
    check_files(source)
    return source


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned little-endian dtype that holds every id."""
    return np.dtype("<u2" if vocab_size <= 2**16 else "<u4")


def _vocab_label(cfg: DataConfig) -> str:
    return f"bytes{BytesTokenizer().vocab_size}" if cfg.tokenizer == "bytes" else f"bpe{cfg.vocab_size}"


def _folder(cfg: DataConfig, source: Source, shard_tokens: int) -> Path:
    recipe = {"format": FORMAT, "source": source.identity(), "tokenizer": cfg.tokenizer,
              "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
              "eval_fraction": cfg.eval_fraction, "shard_tokens": shard_tokens}
    fingerprint = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    return Path(cfg.cache_dir).expanduser() / f"{source.name}-{_vocab_label(cfg)}-{fingerprint}"


def is_prepared(folder: Path) -> bool:
    """Whether ``folder`` holds complete prepared data of the current format."""
    try:
        meta = json.loads((folder / META).read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        shards = [s for split in SPLITS for s in meta["shards"][split]]
        return (meta["format"] == FORMAT
                and all((folder / s["file"]).stat().st_size == s["tokens"] * itemsize for s in shards)
                and any((folder / TOKENIZER_DIR / name).is_file() for name in (BPE_FILE, BYTES_FILE)))
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass
class _Scan:
    train_docs: int = 0
    chars: int = 0
    eval_ids: list[str] = field(default_factory=list)


def _scan(source: Source, eval_fraction: float) -> _Scan:
    """Read every document once (no tokenizing): counts, size and the held-out ids.

    When no document's hash falls below ``eval_fraction`` (a small corpus), the one with the lowest
    hash is held out, the first the rule would take as the fraction grows; likewise one document
    stays in training when every hash falls below it.
    """
    scan, ids = _Scan(), []
    for doc in iter_documents(source):
        scan.chars += len(doc.text)
        ids.append(doc.id)
    if not ids:
        raise ConfigError(f"corpus {source.corpus} is empty: no document has any text")
    if len(ids) == 1:
        raise ConfigError(f"corpus {source.corpus} has one document: at least two are needed to hold one out "
                          "for evaluation")
    held = [i for i in ids if is_held_out(i, eval_fraction)]
    by_hash = sorted(ids, key=id_fraction)
    if not held:
        held = by_hash[:1]
    elif len(held) == len(ids):
        held.remove(by_hash[-1])
    scan.eval_ids, scan.train_docs = held, len(ids) - len(held)
    return scan


class _ShardWriter:
    """Appends tokens to ``<split>_NNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.limit = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._fh: Any = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._fh is None or self.shards[-1]["tokens"] == self.limit:
                self._open_next()
            room = self.limit - self.shards[-1]["tokens"]
            head, tokens = tokens[:room], tokens[room:]
            self._fh.write(head.tobytes())
            self.shards[-1]["tokens"] += len(head)

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):03d}.bin"
        self.shards.append({"file": name, "tokens": 0})
        self._fh = open(self.folder / name, "wb")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc.text)
        if chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _counted(items: Iterable[str], bar: tqdm | Lines) -> Iterator[str]:
    """``items``, each counted on ``bar`` once taken."""
    for item in items:
        yield item
        bar.update(1)


def _entropy_nats(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _build(cfg: DataConfig, source: Source, scan: _Scan, folder: Path, shard_tokens: int, shown: bool) -> None:
    """Write a complete prepared folder into the (empty) ``folder``; with ``shown``, its progress on stderr (a bar on
    a terminal, a line every few seconds elsewhere)."""
    tokenizer: Tokenizer
    held = set(scan.eval_ids)
    if cfg.tokenizer == "bpe":
        train_texts = (d.text for d in iter_documents(source) if d.id not in held)
        with progress_of(scan.train_docs, "training BPE", "doc", enabled=shown) as bar:
            tokenizer = BPETokenizer.train(_counted(train_texts, bar), cfg.vocab_size)
    else:
        tokenizer = BytesTokenizer()
    tokenizer.save(folder / TOKENIZER_DIR)

    dtype = dtype_for(tokenizer.vocab_size)
    writers = {split: _ShardWriter(folder, split, dtype, shard_tokens) for split in SPLITS}
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    bar = progress_of(scan.chars, "tokenizing", "char", enabled=shown)
    try:
        for batch in _batches(iter_documents(source)):
            parts: dict[str, list[list[int]]] = {split: [] for split in SPLITS}
            for doc, ids in zip(batch, tokenizer.encode_batch([d.text for d in batch]), strict=True):
                ids.append(tokenizer.eot_id)
                parts["eval" if doc.id in held else "train"].append(ids)
            for split, lists in parts.items():
                if lists:
                    tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in lists])
                    writers[split].write(tokens)
                    if split == "train":
                        counts += np.bincount(tokens, minlength=len(counts))
            bar.update(sum(len(d.text) for d in batch))
    finally:
        bar.close()
        for w in writers.values():
            w.close()

    meta = {
        "format": FORMAT,
        "corpus": source.corpus,
        "text_field": cfg.text_field,
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype.name,
        "eval_fraction": cfg.eval_fraction,
        "shard_tokens": shard_tokens,
        "shards": {split: writers[split].shards for split in SPLITS},
        "documents": {"train": scan.train_docs, "eval": len(scan.eval_ids)},
        "tokens": {split: sum(s["tokens"] for s in writers[split].shards) for split in SPLITS},
        "eval_ids": scan.eval_ids,
        "unigram_entropy_nats": _entropy_nats(counts),
    }
    write_atomic(folder / META, json.dumps(meta, indent=1) + "\n")


def prepare(cfg: DataConfig, progress: bool = True, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Path:
    """Prepare ``cfg``'s corpus (or find it already prepared) and return the folder.

    Idempotent and safe to run concurrently: nothing is written until the config and every
    document have been checked, and the folder appears only when complete. ``progress`` says on stdout that a
    preparation starts and shows bars on stderr when it is a terminal; ``shard_tokens`` caps the tokens per shard
    file (and is part of the fingerprint).
    """
    if shard_tokens < 1:
        raise ConfigError(f"shard size must be a positive number of tokens, got {shard_tokens}")
    source = _resolve(cfg)
    folder = _folder(cfg, source, shard_tokens)
    if is_prepared(folder):
        return folder
    scan = _scan(source, cfg.eval_fraction)  # every document is read and checked before any write
    if progress:  # the first preparation of a corpus takes seconds to minutes: say so before it starts
        print(f"preparing {cfg.corpus} once ({scan.chars:,} characters: a {cfg.tokenizer} tokenizer and shards) "
              f"into {folder}", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.{_owner()}.", suffix=".tmp"))
    try:
        tmp.chmod(0o755)  # readable like the shard files, not mkdtemp's 0700
        _build(cfg, source, scan, tmp, shard_tokens, progress)
        _move_into_place(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _remove_abandoned(folder: Path) -> None:
    """Delete temporary folders that a killed process of this host left beside ``folder``."""
    host = socket.gethostname()
    for tmp in folder.parent.glob(f".{glob.escape(folder.name)}.*.tmp"):
        owner = tmp.name[len(folder.name) + 2:].split(".", 1)[0]
        who, _, pid = owner.rpartition("-")
        if who == host and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder`` durably (its files synced first); if another process got there first with valid
    data, keep theirs."""
    fsync_tree(tmp)
    for _ in range(5):
        try:
            os.rename(tmp, folder)
            fsync_folder(folder.parent)
            return
        except OSError as e:
            error = e
        if is_prepared(folder):
            return
        # an invalid folder (damaged by hand: ours appear complete): set it aside, then retry
        stale = tmp.with_name(f"{tmp.name}.stale")
        with contextlib.suppress(FileNotFoundError):
            os.rename(folder, stale)
            shutil.rmtree(stale, ignore_errors=True)
    raise error


class TokenStream:
    """The tokens of one split: its read-only memmapped shards, in order."""

    def __init__(self, name: str, shards: list[np.ndarray]) -> None:
        self.name = name
        self.shards = shards

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def require(self, seq_len: int) -> None:
        """ConfigError unless some shard holds a window of ``seq_len + 1`` tokens."""
        longest = max((len(s) for s in self.shards), default=0)
        if longest < seq_len + 1:
            raise ConfigError(f"the {self.name} split has only {longest} tokens in a shard, fewer than "
                              f"seq_len + 1 = {seq_len + 1}; use a larger corpus or a shorter block_size")


@dataclass
class PreparedData:
    """A prepared folder opened for reading."""

    folder: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer
    train: TokenStream
    eval: TokenStream

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @classmethod
    def load(cls, folder: str | Path) -> PreparedData:
        """Open ``folder`` (from ``prepare``): tokenizer, meta and memmapped streams."""
        folder = Path(folder)
        if not is_prepared(folder):
            raise ConfigError(f"no prepared data in {folder}; run launch/prepare.py")
        meta = json.loads((folder / META).read_text())
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")  # shards are little-endian whatever the host
        streams = {split: TokenStream(split, [np.memmap(folder / s["file"], dtype=dtype, mode="r")
                                              for s in meta["shards"][split]])
                   for split in SPLITS}
        return cls(folder, meta, load_tokenizer(folder / TOKENIZER_DIR), streams["train"], streams["eval"])


def summary(folder: Path) -> str:
    """A few lines describing a prepared folder, for the command line."""
    m = json.loads((folder / META).read_text())
    docs, toks = m["documents"], m["tokens"]
    return "\n".join([
        f"prepared   {folder}",
        f"documents  train {docs['train']:,}  eval {docs['eval']:,}",
        f"tokens     train {toks['train']:,}  eval {toks['eval']:,}  "
        f"({len(m['shards']['train'])}+{len(m['shards']['eval'])} shards, {m['dtype']})",
        f"vocab      {m['vocab_size']:,} ({m['tokenizer']})",
        f"unigram entropy  {m['unigram_entropy_nats']:.3f} nats/token",
    ])
