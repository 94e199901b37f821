"""Pause Python's cyclic garbage collector while a save or load runs on the main thread (API-20).

Planning, metadata pickling and unpickling create and drop hundreds of
thousands of small objects, each allocation counting toward the collector's
thresholds: at 20,000 items the collector's full passes cost about as much as
the whole rest of a save. refdcp pauses it for the duration of the call and
restores the caller's setting afterwards, error or not.

Only a call made on the main thread pauses it: a background save
(``async_save``) must not change the collector's behaviour under the training
loop that keeps running meanwhile. Nested and concurrent pauses are counted,
so the collector is re-enabled once, by the last call to finish, and only if
it was enabled when the first one began.

What the call leaves alive (the returned ``Metadata``: about nine tracked
objects per item) would otherwise sit in the youngest generation when the
collector resumes: its next young passes would traverse all of it, and the
survivors pushed into the oldest generation would count toward the next full
pass, which then lands in a later save or load (measured: a 0.16 s full pass
inside a 20,000-item load after a save). So before re-enabling it, objects
that survived the call are moved straight to the oldest generation with
``gc.freeze(); gc.unfreeze()`` (two list splices, no traversal; they are
still collected by full passes). Skipped when the process has frozen
objects of its own (``gc.get_freeze_count() > 0``), which unfreezing would
release.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the collector disabled (main thread only; see the module docstring)."""
    global _depth, _was_enabled
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                if gc.get_freeze_count() == 0:
                    gc.freeze()  # survivors to the oldest generation, untraversed (API-20)
                    gc.unfreeze()
                gc.enable()
