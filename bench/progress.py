"""A one-line progress bar on stderr: `label [#####.....] 5/10 failed 0 3.2s`."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Redraws at most every min_interval_s (always on the last step); on a non-terminal stream it
    writes only the final line, so logs and captured output stay readable."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, width: int = 30,
                 min_interval_s: float = 0.1) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self.done = 0
        self.failed = 0
        self._start = time.perf_counter()
        self._last_draw = -float("inf")
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._closed = False

    def render(self) -> str:
        filled = self.width if self.total == 0 else self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self._start
        prefix = f"{self.label} " if self.label else ""
        return f"{prefix}[{bar}] {self.done}/{self.total} failed {self.failed} {elapsed:.1f}s"

    def update(self, count: int = 1, failed: bool = False) -> None:
        self.done += count
        self.failed += count if failed else 0
        now = time.perf_counter()
        if self._interactive and (self.done >= self.total or now - self._last_draw >= self.min_interval_s):
            self._last_draw = now
            self.stream.write("\r" + self.render())
            self.stream.flush()

    def close(self) -> None:
        """Ends the line (writes the final state once)."""
        if self._closed:
            return
        self._closed = True
        self.stream.write(("\r" if self._interactive else "") + self.render() + "\n")
        self.stream.flush()
