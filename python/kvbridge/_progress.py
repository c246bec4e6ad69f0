"""A dependency-free progress bar for long CLI work (written to stderr)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``with Progress(total, "put") as p: p.update(n)``. Redraws at most 10 times a second;
    disabled (silent) when ``enabled`` is False. ``enabled=None`` means: when the stream is a
    terminal."""

    def __init__(self, total: int, label: str, unit: str = "", *, enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None, width: int = 30):
        self.total = max(int(total), 1)
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def update(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total
        filled = int(frac * self.width)
        rate = self.done / max(now - self._start, 1e-9)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}% {self.done}/{self.total}"
                          f" {self.unit} ({rate:,.0f}/s)")
        self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
