"""The bench progress bar: tqdm on a terminal, one final line elsewhere (logs and captured output stay readable)."""
from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class ProgressBar:
    """update() per finished request (failed ones counted apart); close() ends it. On a terminal tqdm draws
    the bar (`label: 40%|####      | 4/10 [00:03<00:04, failed=0]`); on any other stream only close() writes,
    one line: `label: 10/10 failed 0 3.2s`."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total, self.label = total, label
        self.stream = stream if stream is not None else sys.stderr
        self.done = self.failed = 0
        self._start = time.perf_counter()
        interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = tqdm(total=total, desc=label or None, file=self.stream, leave=True, dynamic_ncols=True,
                         postfix={"failed": 0}) if interactive else None
        self._closed = False

    def update(self, count: int = 1, failed: bool = False) -> None:
        self.done += count
        self.failed += count if failed else 0
        if self._bar is not None:
            if failed:
                self._bar.set_postfix(failed=self.failed, refresh=False)
            self._bar.update(count)

    def close(self) -> None:
        """Ends the bar (idempotent); off a terminal, writes the one final line."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        prefix = f"{self.label}: " if self.label else ""
        self.stream.write(f"{prefix}{self.done}/{self.total} failed {self.failed} {time.perf_counter() - self._start:.1f}s\n")
        self.stream.flush()
