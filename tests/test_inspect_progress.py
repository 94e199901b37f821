"""refdcp.tools.progress: text fallback and tqdm bar (spec/tooling.md, TOOL-9, TOOL-10)."""

from __future__ import annotations

import io

import pytest

from refdcp.tools.progress import Progress, format_bytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TTYStream(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.spec("TOOL-9")
def test_text_lines_are_rate_limited_and_show_throughput() -> None:
    clock, out = FakeClock(), io.StringIO()
    p = Progress(4096, "reading", stream=out, interval=1.0, clock=clock)
    p.update(1024)  # t=0: no line yet
    clock.now += 0.5
    p.update(1024)  # 0.5 s since start: still within the interval
    assert out.getvalue() == ""
    clock.now += 0.5
    p.update(1024)  # 1 s: one line
    clock.now += 0.1
    p.update(0)  # 0.1 s after the last line: none
    assert out.getvalue() == "reading: 3.0 KiB / 4.0 KiB (75%), 3.0 KiB/s\n"


@pytest.mark.spec("TOOL-9")
def test_unknown_total() -> None:
    clock, out = FakeClock(), io.StringIO()
    p = Progress(None, "writing", stream=out, interval=0.0, clock=clock)
    clock.now += 2.0
    p.update(2048)
    assert out.getvalue() == "writing: 2.0 KiB, 1.0 KiB/s\n"


@pytest.mark.spec("TOOL-10")
def test_summary_line_once() -> None:
    clock, out = FakeClock(), io.StringIO()
    with Progress(None, "copy", stream=out, interval=10.0, clock=clock) as p:
        clock.now += 4.0
        p.update(8 * 1024 * 1024)
        p.close()
    assert out.getvalue() == "copy done: 8.0 MiB in 4.00 s (2.0 MiB/s)\n"


@pytest.mark.spec("TOOL-10")
def test_summary_marks_failure() -> None:
    clock, out = FakeClock(), io.StringIO()
    with (
        pytest.raises(ValueError),
        Progress(10, "copy", stream=out, interval=10.0, clock=clock) as p,
    ):
        clock.now += 1.0
        p.update(5)
        raise ValueError("boom")
    assert out.getvalue() == "copy failed after 5 B in 1.00 s (5 B/s)\n"


@pytest.mark.spec("TOOL-9")
def test_tty_uses_tqdm_bar() -> None:
    pytest.importorskip("tqdm", reason="tqdm is a test dependency (pyproject [test])")
    out = TTYStream()
    with Progress(2048, "reading", stream=out) as p:
        assert p._bar is not None
        p.update(2048)
    text = out.getvalue()
    assert "reading" in text and "100%" in text
    assert "done:" not in text


@pytest.mark.spec("TOOL-9")
def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 GiB",
    ]
