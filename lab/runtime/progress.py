"""Progress of long work: tqdm's bar on a terminal; elsewhere (a log, a pipe) one plain line every few seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

EVERY_S = 5.0  # seconds between two lines off a terminal


class Lines:
    """What a caller uses of a tqdm bar (``update``, ``set_postfix_str``, ``write``, ``close``), shown as a line
    ``DESC: N/TOTAL UNITs after S s (POSTFIX)`` at most every ``every_s`` seconds."""

    disable = False

    def __init__(self, total: int, desc: str, unit: str, file: TextIO, initial: int = 0,
                 every_s: float = EVERY_S) -> None:
        self.total, self.desc, self.unit, self.file, self.n = total, desc, unit, file, initial
        self.every_s, self.postfix = every_s, ""
        self.start = self.shown = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        self._show()

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        """Nothing to clear: every line stays."""

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _show(self) -> None:
        now = time.monotonic()
        if now - self.shown < self.every_s:
            return
        self.shown = now
        extra = f" ({self.postfix})" if self.postfix else ""
        self.write(f"{self.desc}: {self.n}/{self.total} {self.unit}s after {now - self.start:.0f} s{extra}")


def progress(total: int, desc: str, unit: str, enabled: bool = True, file: TextIO | None = None,
             initial: int = 0, leave: bool = True) -> tqdm | Lines:
    """A bar on a terminal (kept at the end with ``leave``), ``Lines`` elsewhere, nothing (a disabled bar) when
    not ``enabled``; on stderr unless ``file`` is given."""
    file = file or sys.stderr
    if not enabled:
        return tqdm(total=total, initial=initial, disable=True)
    if file.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, dynamic_ncols=True,
                    leave=leave)
    return Lines(total, desc, unit, file, initial)
