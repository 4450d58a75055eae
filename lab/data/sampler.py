"""Reading token windows: random training batches addressed by step, fixed evaluation batches.

A training step's global batch is a pure function of ``(seed, step, global_sequences)``, so the
data position is the step number alone: resuming needs no sampler state, and any split of the
batch across ranks and micro-steps reads the same windows. Windows never cross a shard boundary.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from lab.data.shards import TokenStream


def _windows(shards: list[np.ndarray], per_shard: np.ndarray, index: np.ndarray, stride: int,
             seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, int64 ``[len(index), seq_len]``, of the windows numbered
    ``index`` when shard ``i`` holds ``per_shard[i]`` windows starting every ``stride`` tokens."""
    ends = np.cumsum(per_shard)
    shard = np.searchsorted(ends, index, side="right")
    start = (index - (ends - per_shard)[shard]) * stride
    rows = np.empty((len(index), seq_len + 1), dtype=np.int64)
    for i, (sh, st) in enumerate(zip(shard.tolist(), start.tolist(), strict=True)):
        rows[i] = shards[sh][st:st + seq_len + 1]
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class BatchSampler:
    """Uniformly random windows of ``seq_len + 1`` tokens over every valid start of every shard."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        stream.require(seq_len)
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self._starts = np.array([max(len(s) - seq_len, 0) for s in stream.shards], dtype=np.int64)
        self.n_windows = int(self._starts.sum())  # distinct windows drawn from

    def batch(self, step: int, global_sequences: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences ``lo..hi-1`` of step ``step``'s global batch of ``global_sequences`` windows:
        inputs ``x`` and targets ``y`` (``x`` shifted by one), int64 ``[hi - lo, seq_len]``."""
        if step < 0 or not 0 <= lo <= hi <= global_sequences:
            raise ValueError(f"need step >= 0 and 0 <= lo <= hi <= global_sequences, "
                             f"got step={step} lo={lo} hi={hi} global_sequences={global_sequences}")
        rng = np.random.default_rng([self.seed, step])
        index = rng.integers(0, self.n_windows, size=global_sequences)[lo:hi]
        return _windows(self.stream.shards, self._starts, index, 1, self.seq_len)


def eval_batches(stream: TokenStream, seq_len: int, n_tokens: int, batch_size: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches: ``n_tokens // seq_len`` (at least one) non-overlapping windows,
    capped by what the stream holds, spread evenly over it; the last batch may be smaller."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
    stream.require(seq_len)  # checked here, not at the first next()
    per_shard = np.array([(len(s) - 1) // seq_len for s in stream.shards], dtype=np.int64)
    total = int(per_shard.sum())
    index = np.linspace(0, total, min(max(n_tokens // seq_len, 1), total), endpoint=False).astype(np.int64)
    return (_windows(stream.shards, per_shard, index[b:b + batch_size], seq_len, seq_len)
            for b in range(0, len(index), batch_size))
