"""The reference save refuses, while planning and before writing, every value a default load
could never read back (SAVE-12), one line per key naming its type and cause; what it refuses
loads nowhere, what it keeps round-trips. This runs the reference alone (the reference-run
suite of HARN-26); test_reference_differential_loadable.py compares it with the fast path."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp.reference
from refdcp.errors import CheckpointError
from refdcp.planning.errors import UnloadableValueError

SINGLE_PATH = "runs the reference alone (HARN-26); test_reference_differential_loadable compares it with the fast path"


class Opaque:
    """A class no allow-list names."""

    def __init__(self, n: int = 1) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


BAD: dict[str, tuple[Any, str]] = {
    "meta": (torch.empty(3, device="meta"), "meta"),
    "sparse": (torch.eye(2).to_sparse(), "sparse"),
    "csr": (torch.eye(3).to_sparse_csr(), "sparse_csr"),
    "lock": (threading.Lock(), "cannot be pickled"),
    "lambda": (lambda: 1, "cannot be pickled"),
    "opaque": (Opaque(), "weights_only"),
}


@pytest.mark.spec("SAVE-12", "REF-1")
@pytest.mark.parametrize("name", sorted(BAD))
def test_the_reference_refuses_an_unloadable_value_before_writing(
    tmp_path: Path, name: str
) -> None:
    value, cause = BAD[name]
    sd = {"net": {"bad": value, "w": torch.ones(2)}, "step": 3}
    with pytest.raises(CheckpointError) as info:
        refdcp.reference.save(sd, checkpoint_id=str(tmp_path))
    assert info.value.step == "local_plan"
    err = info.value.rank_failures[0].exception
    assert isinstance(err, UnloadableValueError)
    assert len(err.problems) == 1
    line = err.problems[0]
    assert line.startswith("key 'net.bad', type ") and type(value).__qualname__ in line
    assert cause in line
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.spec("SAVE-12", "REF-1")
def test_the_reference_lists_every_refused_key_and_honours_safe_globals(tmp_path: Path) -> None:
    sd = {"a": Opaque(2), "b": threading.Lock(), "c": {"ok": [1, 2.5, "x"]}, "d": Opaque(3)}
    with pytest.raises(CheckpointError) as info:
        refdcp.reference.save(dict(sd), checkpoint_id=str(tmp_path / "x"))
    err = info.value.rank_failures[0].exception
    assert isinstance(err, UnloadableValueError)
    assert [p.split(",")[0] for p in err.problems] == ["key 'a'", "key 'b'", "key 'd'"]
    # Allowed by safe_globals at save (and at load), an object saves and loads back.
    planner = refdcp.reference.ReferenceSavePlanner(safe_globals=[Opaque])
    kept = {"a": Opaque(2), "c": {"ok": [1, 2.5, "x"]}}
    refdcp.reference.save(kept, checkpoint_id=str(tmp_path / "y"), planner=planner)
    dest: dict[str, Any] = {"a": None, "c": {"ok": None}}
    refdcp.load(dest, checkpoint_id=str(tmp_path / "y"), no_dist=True, safe_globals=[Opaque])
    assert dest == kept
