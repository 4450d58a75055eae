"""The gradient noise scale, measured online (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

B_simple = tr(Σ) / |G|² is the batch, in tokens, at which a step's gradient noise equals its signal: training at a
batch well below it wastes few tokens, well above it few steps. Every step holds the two measurements its estimators
need: the gradients of the loop's micro-batches (the small batch, B_small tokens, the same under every layout) and the
step's whole gradient (the big batch, B_big = K · B_small over its K micro-batches of every data-parallel rank). With
|g|² the mean over the K micro-batches of each one's squared gradient norm and |G_B|² the step's (the clip's norm):

    |G|²  ≈ (B_big |G_B|² − B_small |g|²) / (B_big − B_small)      unbiased estimators (McCandlish et al., app. A)
    tr(Σ) ≈ (|g|² − |G_B|²) / (1/B_small − 1/B_big)

Each is smoothed over steps by an exponential average (weight ``SMOOTHING`` on the past, debiased as Adam's moments
are) before their ratio is taken: the ratio of two noisy estimates is biased, the ratio of their averages much less.

Each micro-batch's gradient is read by a hook on every tensor autograd accumulates gradients into
(``Strategy.gradient_leaves``): the hook sees the gradient of one backward before anything adds or syncs it, so every
data-parallel strategy's sync is left as it is. An expert's weights take other ranks' tokens in the same backward:
each use of them (one source rank's rows) goes through a tap (``Transform.tap_uses``) that reads its part apart; the
step's sum of squares needs no more (every micro-batch's part of every weight is counted once, wherever it is). Where a micro-step runs several backwards (a pipeline's
microbatches) or a transform completes a gradient from several ranks' parts (a weight two stages share), the parts
are added up in a buffer first (one gradient's memory for those weights); where a micro-batch's tokens are split
over ranks (context parallelism), each gradient is then summed over them (an all-reduce of the whole gradient per
micro-step, not counted with the data-parallel traffic) and counted by the first. Its squares are counted as the global
norm counts them (``holding.add_counted_squares``: a split weight's replicated rows once), summed over the step's
micro-steps, and added over every rank in the all-reduce the global norm already makes: no collective of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lab.measure.figures import Figures
from lab.parallel import holding
from lab.parallel.axes import Transform

SMOOTHING = 0.95  # the exponential average's weight on the past: about 20 steps


def noise_estimates(small_sq: float, big_sq: float, small_tokens: float, big_tokens: float) -> tuple[float, float]:
    """McCandlish's unbiased estimates of |G|² and tr(Σ) from the mean squared norm of gradients over
    ``small_tokens`` (``small_sq``) and the squared norm of their mean over ``big_tokens`` (``big_sq``)."""
    grad_sq = (big_tokens * big_sq - small_tokens * small_sq) / (big_tokens - small_tokens)
    trace = (small_sq - big_sq) / (1 / small_tokens - 1 / big_tokens)
    return grad_sq, trace


class GradientNoise(Figures):
    """This rank's micro-batch gradient squares, and the run's smoothed noise scale."""

    line_place = 95

    def __init__(self, transforms: Sequence[Transform], micro_batches: int, buffered: bool):
        self.transforms = transforms
        self.micro_batches = micro_batches  # K: the step's micro-batches over every data-parallel rank
        self.apart = set().union(*(t.held_apart() for t in transforms))  # completed from several ranks' parts
        self.parts = [w for t in transforms if (w := t.micro_batch_parts()) is not None]  # ranks adding up one's
        # several backwards a micro-step, or ranks that each hold a part: every gradient is added up first
        self.buffered = buffered or bool(self.parts)
        self.micro_tokens = 0  # tokens of one micro-batch (set by the engine's forward)
        self._parts: dict[str, torch.Tensor] = {}  # this micro-step's buffered gradients, by name
        self._squares: torch.Tensor | None = None  # this micro-step's counted squares so far (fp32, on the device)
        self._step: torch.Tensor | None = None  # this step's, each micro-step's scaled
        self._smoothed_grad_sq = self._smoothed_trace = 0.0
        self._measured = 0  # steps the averages hold
        self._leaves: dict[str, torch.Tensor] = {}
        self.last: dict[str, float | None] = {}

    def watch(self, leaves: list[tuple[str, torch.Tensor]]) -> None:
        """Hook the gradient of every leaf ``leaves`` name; a weight whose gradient adds other ranks' micro-batches'
        parts (``Transform.mixed_gradients``) is read at each use instead (``tap``)."""
        mixed = set().union(*(t.mixed_gradients() for t in self.transforms))
        for name, leaf in leaves:
            if name not in mixed:
                self._leaves[name] = leaf
                leaf.register_hook(lambda grad, name=name: self._arrived(name, grad))
        for transform in self.transforms:
            transform.tap_uses(self.tap)

    def tap(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as one use runs it: the part of its gradient that use gives is read apart."""
        return _Tap.apply(weight, self, name)

    def _arrived(self, name: str, grad: torch.Tensor) -> None:
        grad = grad.detach()
        grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor: this rank's part
        if self.buffered or name in self.apart:
            if name in self._parts:
                self._parts[name] += grad.reshape(-1)
            else:
                self._parts[name] = grad.reshape(-1).clone()
        else:
            self._count(name, grad.reshape(-1))

    def _count(self, name: str, flat: torch.Tensor) -> None:
        if self._squares is None:
            self._squares = torch.zeros((), dtype=torch.float32, device=flat.device)
        if holding.first_of_axes(name, self.transforms):
            holding.add_counted_squares(self._squares, name, flat, 0, self.transforms)

    def end_micro_step(self, gradient_scale: float) -> None:
        """The micro-step's backwards are done (nothing synced yet): count what was buffered, and scale this
        micro-step's squares by ``gradient_scale``² (what turns the backward's gradients into the micro-batch mean
        loss's: the accumulation's and the loss scale's factors undone)."""
        if self._parts:
            for transform in self.transforms:
                transform.complete_gradients(self._part)
            self._add_up_parts()
            for name, flat in self._parts.items():
                self._count(name, flat)
            self._parts = {}
        if self._squares is not None:
            scaled = self._squares * gradient_scale ** 2
            self._step = scaled if self._step is None else self._step + scaled
        self._squares = None

    def _add_up_parts(self) -> None:
        """Each buffered gradient summed over the ranks that each ran a part of the micro-batch, then counted by the
        first of them alone (one all-reduce of the whole gradient per micro-step and axis)."""
        for world in self.parts:
            names = sorted(self._leaves)
            flat = torch.cat([self._part(name).float() for name in names])
            dist.all_reduce(flat, group=world.group)
            if world.rank != 0:
                self._parts = {}
                return
            self._parts = dict(zip(names, flat.split([self._parts[n].numel() for n in names])))

    def _part(self, name: str) -> torch.Tensor:
        """The buffered gradient of ``name`` (zeros where no backward of this micro-step reached it)."""
        if name not in self._parts:
            leaf = self._leaves[name]
            local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
            self._parts[name] = torch.zeros(local.numel(), dtype=local.dtype, device=local.device)
        return self._parts[name]

    def take_squares(self, device: torch.device) -> torch.Tensor:
        """This rank's counted squares of this step's micro-batch gradients (to be summed over every rank)."""
        squares, self._step = self._step, None
        return torch.zeros((), dtype=torch.float32, device=device) if squares is None else squares.to(device)

    def end_step(self, small_squares: float, big_norm: float) -> None:
        """Update the estimates from the step's micro-batch squares summed over every rank and its global gradient
        norm (unscaled, before clipping; a non-finite one, a skipped step, leaves them as they are)."""
        if not math.isfinite(big_norm):
            return
        self._measured += 1
        small_sq, big_sq = small_squares / self.micro_batches, big_norm ** 2
        small_tokens = self.micro_tokens
        grad_sq, trace = noise_estimates(small_sq, big_sq, small_tokens, small_tokens * self.micro_batches)
        self._smoothed_grad_sq = SMOOTHING * self._smoothed_grad_sq + (1 - SMOOTHING) * grad_sq
        self._smoothed_trace = SMOOTHING * self._smoothed_trace + (1 - SMOOTHING) * trace
        debias = 1 - SMOOTHING ** self._measured
        smooth_grad_sq, smooth_trace = self._smoothed_grad_sq / debias, self._smoothed_trace / debias
        self.last = {"noise_scale": smooth_trace / smooth_grad_sq if smooth_grad_sq > 0 else None,
                     "noise_scale_step": trace / grad_sq if grad_sq > 0 else None,
                     "noise_small_sq": small_sq, "noise_big_sq": big_sq,
                     "noise_grad_sq": smooth_grad_sq, "noise_trace": smooth_trace}

    def state_dict(self) -> dict[str, float]:
        """The averages a resumed run goes on from (a checkpoint's metadata)."""
        return {"grad_sq": self._smoothed_grad_sq, "trace": self._smoothed_trace, "steps": self._measured}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._smoothed_grad_sq, self._smoothed_trace = float(state["grad_sq"]), float(state["trace"])
        self._measured = int(state["steps"])

    def record(self) -> dict[str, object]:
        return dict(self.last)

    def meters(self) -> dict[str, object]:
        return {"noise_scale": self.last.get("noise_scale"), "noise_scale_smoothing": SMOOTHING}

    @staticmethod
    def line(rec: dict) -> str:
        """The smoothed noise scale, in tokens."""
        value = rec.get("noise_scale")
        if "noise_scale" not in rec:
            return ""
        return " | B_noise " + ("n/a" if value is None else f"{value:,.0f} tok")


class _Tap(torch.autograd.Function):
    """Identity forward; the backward hands the gradient of this use to the meter, then passes it on."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, meter: GradientNoise, name: str) -> torch.Tensor:
        ctx.meter, ctx.name = meter, name
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.meter._arrived(ctx.name, grad)
        return grad, None, None
