"""Progress and throughput for long CLI operations (spec/tooling.md, TOOL-9, TOOL-10).

On a terminal a ``tqdm`` bar is shown (when tqdm is installed); otherwise
plain text lines go to the stream, at most one per ``interval`` seconds, and a
final summary line with the total and the average throughput.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """``with Progress(total, "reading") as p: p.update(nbytes)`` (TOOL-9)."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        stream: TextIO | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        use_tqdm: bool | None = None,
    ) -> None:
        self.total = total
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.clock = clock
        self.done = 0
        self._start = clock()
        self._last_print = self._start
        self._bar: Any = None
        self._closed = False
        if use_tqdm is None:
            use_tqdm = bool(getattr(self.stream, "isatty", lambda: False)())
        if use_tqdm:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: fall back to text
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total, desc=desc, unit="B", unit_scale=True, file=self.stream
                )

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)

    def rate(self) -> float:
        """Average bytes per second so far."""
        elapsed = self.clock() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = self.clock()
        if now - self._last_print >= self.interval:
            self._last_print = now
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def _line(self) -> str:
        of = f" / {format_bytes(self.total)}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.desc}: {format_bytes(self.done)}{of}{pct}, {format_bytes(self.rate())}/s"

    def close(self, *, failed: bool = False) -> None:
        """Finish the bar, or print the summary line, once (TOOL-10)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            return
        elapsed = self.clock() - self._start
        status = "failed after" if failed else "done:"
        self.stream.write(
            f"{self.desc} {status} {format_bytes(self.done)} in {elapsed:.2f} s "
            f"({format_bytes(self.rate())}/s)\n"
        )
        self.stream.flush()
