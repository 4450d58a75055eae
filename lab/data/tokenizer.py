"""Tokenizers: byte-level BPE trained on the corpus, or raw UTF-8 bytes.

Both reserve one special token, ``<|endoftext|>``, placed after every document. It is never
produced from text: a document that contains the literal string is tokenized as plain text.
``decode`` renders the end-of-text id as ``<|endoftext|>`` and invalid UTF-8 as U+FFFD.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lab.runtime.config import ConfigError
from lab.runtime.files import write_atomic

EOT = "<|endoftext|>"
KINDS = ("bpe", "bytes")
BPE_FILE = "tokenizer.json"
BYTES_FILE = "bytes_tokenizer.json"


class Tokenizer(ABC):
    """Text ↔ token ids, with an end-of-text id that separates documents."""

    kind: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, special token included."""

    @property
    @abstractmethod
    def eot_id(self) -> int:
        """Id of ``<|endoftext|>``."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of a text (no end-of-text appended)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""

    @abstractmethod
    def save(self, folder: str | Path) -> Path:
        """Write the tokenizer into ``folder`` (created if needed); returns the file written."""


class BytesTokenizer(Tokenizer):
    """The 256 byte values of UTF-8, then end-of-text as id 256."""

    kind = "bytes"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eot_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        parts, buf = [], bytearray()
        for i in ids:
            if i == self.eot_id:
                parts += [buf.decode("utf-8", errors="replace"), EOT]
                buf = bytearray()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise ValueError(f"token id {i} is outside the bytes vocabulary (0..256)")
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / BYTES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"kind": self.kind, "vocab_size": self.vocab_size,
                                       "eot_id": self.eot_id}) + "\n")
        return path


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenization, no prefix space) from Hugging Face tokenizers."""

    kind = "bpe"

    def __init__(self, hf: HFTokenizer) -> None:
        eot = hf.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"BPE tokenizer has no {EOT} token")
        hf.encode_special_tokens = True  # "<|endoftext|>" inside a document stays plain text
        self.hf = hf
        self._eot = eot

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn merges from ``texts`` until the vocabulary (with ``<|endoftext|>``) has ``vocab_size`` ids,
        or the texts run out of pairs to merge."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eot_id(self) -> int:
        return self._eot

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / BPE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.hf.to_str())
        return path


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in ``folder`` by ``Tokenizer.save`` (``prepare`` uses ``<prepared>/tokenizer``)."""
    folder = Path(folder)
    if (folder / BPE_FILE).is_file():
        return BPETokenizer(HFTokenizer.from_file(str(folder / BPE_FILE)))
    if (folder / BYTES_FILE).is_file():
        return BytesTokenizer()
    raise ConfigError(f"no tokenizer in {folder} (expected {BPE_FILE} or {BYTES_FILE})")
