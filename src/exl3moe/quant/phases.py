"""Exclusive wall time per named phase of an encoder call (a nested phase pauses its parent's clock).

`phase(name)` does nothing outside `timing(...)`. With sync, the device is synchronised at every phase boundary so
that GPU work is charged to the phase that queued it (EXL3MOE_QUANT_SYNC_PHASES=1 or quantize_weights(sync_phases=
True)); without it a boundary costs two perf_counter calls and the times are host times.
"""

from __future__ import annotations

import contextvars
import os
import time
from contextlib import contextmanager

import torch

SYNC_ENV = "EXL3MOE_QUANT_SYNC_PHASES"
# The phases of quantize_weights, in pipeline order (docs/quant.md, Speed).
PHASES = ("checks", "scales", "scale_search", "hessian", "ldlq", "search_bound", "search_seams", "refine", "pack",
          "proxy_error", "refit", "other")
_current: contextvars.ContextVar = contextvars.ContextVar("exl3moe_phase_timer", default=None)


def sync_requested() -> bool:
    return os.environ.get(SYNC_ENV, "0") == "1"


class PhaseTimer:
    def __init__(self, sync: bool = False):
        self.seconds: dict = {}
        self.parts: dict = {}  # inclusive seconds of parts that cut across phases (the passes, the tracebacks)
        self.counts: dict = {}
        self.sync = sync
        self.device: torch.device | None = None  # set once known; synchronised only when CUDA
        self._stack: list = []
        self._mark = time.perf_counter()

    def _tick(self) -> None:
        if self.sync and self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self._stack:
            name = self._stack[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._mark
        self._mark = now

    @contextmanager
    def part(self, name: str):
        self._tick()
        start = self._mark
        try:
            yield
        finally:
            self._tick()
            self.parts[name] = self.parts.get(name, 0.0) + self._mark - start

    @contextmanager
    def phase(self, name: str):
        self._tick()
        self._stack.append(name)
        try:
            yield
        finally:
            self._tick()
            self._stack.pop()


@contextmanager
def timing(sync: bool = False):
    """Collect phases of the calls inside; yields the PhaseTimer (its `seconds`: phase -> exclusive seconds)."""
    timer = PhaseTimer(sync)
    token = _current.set(timer)
    try:
        with timer.phase("other"):
            yield timer
    finally:
        _current.reset(token)


@contextmanager
def _on_current(kind: str, name: str):
    """The current timing's `kind` ("part" or "phase") context for `name`; nothing outside a timing."""
    timer = _current.get()
    if timer is None:
        yield
        return
    with getattr(timer, kind)(name):
        yield


def part(name: str):
    """Time a part inclusively (into the timer's `parts`) without changing which phase is charged."""
    return _on_current("part", name)


def count(name: str, amount: int) -> None:
    """Add `amount` to the counter `name` of the current timing (nothing outside one)."""
    timer = _current.get()
    if timer is not None:
        timer.counts[name] = timer.counts.get(name, 0) + int(amount)


def phase(name: str):
    """Charge the time inside to phase `name` (exclusive: a nested phase pauses it)."""
    return _on_current("phase", name)
