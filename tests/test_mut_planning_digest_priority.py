"""The value-digest worker runs at the lowest CPU priority on Linux (DEDUP-17)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from refdcp.planning.dedup.deferred import _lower_priority


@pytest.mark.spec("DEDUP-17")
@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are set on Linux only")
def test_the_digest_thread_lowers_its_own_priority_only() -> None:
    seen: dict[str, int] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        _lower_priority()
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, tid)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
