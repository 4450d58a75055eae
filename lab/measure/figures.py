"""What a part of a run reports on it: one small interface for every transform (``lab.parallel.axes``) and every model
feature (a mixture's router), which the strategy loops over (``Strategy.take_record``, ``Accounts.meters``), so that
the training loop formats what it gets and names none of them. The step line gathers the fragments of every part a
run can have (``lab.parallel.step_line``: the transforms' one list, ``lab.parallel.axes.kinds``, the model's features
and the precision policy's loss scaler)."""

from __future__ import annotations

from typing import ClassVar


class Figures:
    """One part's figures, each method defaulting to none: its fields of a logged step's record (``record``: every
    rank calls it at the same steps, so it may all-reduce), its fields of the run's summary (``meters``) and its
    fragment of the step line (``line``: from a record alone, so that a record read back prints the same), at its
    place in that line (``line_place``: lower first; a part that names none follows the others)."""

    line_place: ClassVar[int] = 100

    def record(self) -> dict[str, object]:
        return {}

    def meters(self) -> dict[str, object]:
        return {}

    @staticmethod
    def line(rec: dict) -> str:
        return ""
