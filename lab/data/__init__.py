"""Data: corpora, held-out split, tokenizers, prepared memmap shards and batch sampling."""

from lab.data.cli import prepare_main
from lab.data.sampler import BatchSampler, eval_batches
from lab.data.shards import PreparedData, check_source, prepare
from lab.data.tokenizer import load_tokenizer

__all__ = ["prepare", "check_source", "PreparedData", "BatchSampler", "eval_batches", "load_tokenizer",
           "prepare_main"]
