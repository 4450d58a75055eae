"""What a run's steps cost beyond compute, and what its parts report, kept apart from how the step runs.

Every data-parallel group's collectives count the bytes they send and the seconds they wait (``lab.parallel.comm``);
each transform counts its own traffic (``Transform.take_meters``); the activation meter counts what a micro-step saves
for its backward (``lab.parallel.axes.activations.SavedBytes``). ``RunMeters`` takes them once per step, hands them to
the accounts (theory beside measurement: ``lab.parallel.accounts``) and gathers the figures of every part that
reports on the run (``lab.measure.figures``): the transforms, the model's own (a mixture's router) and fp16's loss
scaler.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from lab.measure.figures import Figures
from lab.parallel.axes import Transform
from lab.parallel.axes.activations import SavedBytes
from lab.parallel.comm import Comm
from lab.parallel.layout import World


@dataclass(frozen=True)
class StepMeters:
    """What one optimizer step cost beyond compute."""

    comm_bytes: dict[str, float]  # sent by this rank over the data-parallel groups, by collective
    comm_wait_s: float  # time the step waited on communication (every axis)
    activation_saved_bytes: int  # the most any micro-step kept for its backward
    layout: dict[str, object] = dataclasses.field(default_factory=dict)  # the transforms' own figures


class RunMeters:
    """The meters of one run on this rank: ``comms()`` lists the data-parallel groups' collectives (the data axis's
    first), ``record`` receives each step's meters (the accounts')."""

    def __init__(self, comms: Callable[[], list[Comm]], transforms: Sequence[Transform], saved: SavedBytes,
                 everyone: World, own: Sequence[Figures], record: Callable[[StepMeters], None]):
        self.comms, self.transforms, self.saved, self.everyone = comms, transforms, saved, everyone
        self.own, self.record = list(own), record  # parts besides the transforms (fp16's loss scaler)
        self.model_figures: list[Figures] = []

    def watch_model(self, module: nn.Module) -> None:
        """Report the built model's own figures too (its ``figures``, where it has them: a mixture's router)."""
        own = getattr(module, "figures", None)
        self.model_figures = own(self.sum_token_figures) if own is not None else []

    def take_step(self) -> StepMeters:
        """Bytes sent over the data-parallel groups and seconds waited (on every axis) since the last call (once per
        step), the transforms' figures and the activation bytes saved."""
        sent: dict[str, float] = {}
        wait_s, layout = 0.0, {}
        for comm in self.comms():
            totals = comm.take()
            wait_s += totals.wait_s
            sent = {kind: sent.get(kind, 0.0) + n for kind, n in totals.bytes.items()}
        for transform in self.transforms:
            taken = transform.take_meters()
            wait_s += taken.wait_s
            layout |= taken.record
        meters = StepMeters(sent, wait_s, self.saved.take(), layout)
        self.record(meters)
        return meters

    def figures(self) -> list[Figures]:
        """Every part of the run that reports on it."""
        return [*self.transforms, *self.model_figures, *self.own]

    def take_record(self) -> dict[str, object]:
        """Every part's fields of a logged step's record since the last one (every rank calls it at the same
        steps)."""
        return {k: v for part in self.figures() for k, v in part.record().items()}

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """No traffic inside is a training step's (every group's and transform's meters paused)."""
        with contextlib.ExitStack() as stack:
            for comm in self.comms():
                stack.enter_context(comm.paused())
            for transform in self.transforms:
                stack.enter_context(transform.paused())
            yield

    def sum_token_figures(self, figures: torch.Tensor) -> torch.Tensor:
        """Per-token figures (a router's counts) summed over every rank of the run, each token once (a rank whose
        tokens another rank also runs adds nothing)."""
        if not all(t.sees_own_tokens() for t in self.transforms):
            figures = torch.zeros_like(figures)
        return self.everyone.sum(figures)
