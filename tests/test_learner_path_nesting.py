"""The learner-path measure (REF-5) traces inside whatever traces it: the tracers set before
it, on this thread and for new threads, are set again after it. (The mutation runner finds the
tests that ran a line with such tracers; one left unset hid every later test from it.)"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import refdcp.reference
from refdcp.tools.learner_path import traced_files


@pytest.mark.spec("REF-5")
def test_the_measure_sets_the_callers_tracers_again() -> None:
    outer, outer_threads = sys.gettrace(), threading.gettrace()

    def mine(frame: FrameType, event: str, arg: Any) -> None:
        return None

    def theirs(frame: FrameType, event: str, arg: Any) -> None:
        return None

    sys.settrace(mine)
    threading.settrace(theirs)
    try:
        under = Path(refdcp.reference.__file__).parent
        seen = traced_files(lambda: refdcp.reference.format.data_file_name(0, "t"), under)
        assert sys.gettrace() is mine and threading.gettrace() is theirs
    finally:
        sys.settrace(outer)
        threading.settrace(outer_threads)
    assert seen == {under / "format.py"}
