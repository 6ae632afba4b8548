"""The phases of a command: ``progress(message)`` hears each as it starts, and the seconds each
took are what ``--timings`` and ``timings=True`` report (both wings, explain and check)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: ``progress(message)``: told each phase of a command as it starts.
Progress = Callable[[str], None]


class Clock:
    """``lap(name)`` ends a phase that began where the last one ended (or at the start);
    ``timed(name, job)`` times a job that runs beside the phases, on another thread, under
    ``"{name} (concurrent)"``. Seconds rounded to 0.1 ms."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._laps: dict[str, float] = {}
        self._beside: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self._laps[name] = round(now - self._last, 4)
        self._last = now

    def timed(self, name: str, job: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return job()
        finally:
            self._beside[f"{name} (concurrent)"] = round(time.perf_counter() - started, 4)

    def laps(self, wanted: bool = True) -> dict[str, float] | None:
        """The phases in order, then the jobs beside them; None unless ``wanted``."""
        return {**self._laps, **self._beside} if wanted else None


__all__ = ["Clock"]

