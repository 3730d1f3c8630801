"""How long an observation spent in FSDP (and in DTensor and DCP under it):
an area's measure for the bench (AreaScenario.fsdp_seconds). A scenario
times the phases that are FSDP's work (wrapping, training, reading full
values, state dicts, clipping) and leaves out its own: building models,
single-process references, comparisons."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Stopwatch:
    """Seconds summed over the phases timed with ``with watch.timing():``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0
