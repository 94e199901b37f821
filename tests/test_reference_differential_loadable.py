"""The reference's refusal rule (SAVE-12: pickle the value, read it back as a default load
would) against the fast path's (a plain-data walk first, the same round trip otherwise): for
generated state dicts mixing loadable and unloadable values, with and without an allowing
``safe_globals``, both paths refuse exactly the same keys at ``local_plan`` before writing
anything, or both commit (REF-1, REF-4; what they commit loads alike: REF-2's tests)."""

from __future__ import annotations

import collections
import os
import re
import tempfile
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import refdcp
import refdcp.reference
from refdcp.errors import CheckpointError
from refdcp.planning.errors import UnloadableValueError

SINGLE_PATH = "differential: compares the reference's refusal rule with the fast path's (REF-1, REF-4), so it calls both itself"


class Opaque:
    """A class no allow-list names unless a test passes it in ``safe_globals``."""

    def __init__(self, n: int = 1) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def _values() -> dict[str, Any]:
    return {
        "int": 7,
        "str": "text",
        "plain": {"a": [1, 2.5, None, "x"], "b": (True, b"raw")},
        "dense": torch.arange(6.0).reshape(2, 3),
        "quantized": torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint8),
        "set": {1, 2, 3},
        "ordered": collections.OrderedDict(z=1, a=2),
        "counter": collections.Counter(a=2),
        "numpy": np.arange(3),
        "opaque": Opaque(4),
        "opaque_in_list": [1, Opaque(5)],
        "lock": threading.Lock(),
        "lambda": lambda: 0,
        "meta": torch.empty(2, device="meta"),
        "sparse": torch.eye(2).to_sparse(),
        "deep": [[[[[[[1]]]]]]],
    }


def _refused(save: Any, sd: dict[str, Any], path: str, planner: Any) -> list[str] | None:
    """The keys refused at local_plan, in order, or None when the save commits."""
    try:
        save(sd, checkpoint_id=path, planner=planner)
    except CheckpointError as exc:
        assert exc.step == "local_plan" and exc.committed is False, exc
        err = exc.rank_failures[0].exception
        assert isinstance(err, UnloadableValueError), err
        return [re.match(r"key '([^']*)'", p).group(1) for p in err.problems]  # type: ignore[union-attr]
    return None


@pytest.mark.spec("SAVE-12", "REF-1", "REF-4")
@given(
    names=st.lists(st.sampled_from(sorted(_values())), min_size=1, max_size=5, unique=True),
    allow=st.booleans(),
)
def test_both_paths_refuse_the_same_keys(names: list[str], allow: bool) -> None:
    values = _values()
    sd = {name: values[name] for name in names}
    sd["w"] = torch.ones(2)
    safe = [Opaque] if allow else []
    with tempfile.TemporaryDirectory() as d:
        fast = _refused(
            lambda s, **kw: refdcp.save(s, no_dist=True, **kw),
            dict(sd),
            f"{d}/fast",
            refdcp.DefaultSavePlanner(safe_globals=safe),
        )
        ref = _refused(
            refdcp.reference.save,
            dict(sd),
            f"{d}/ref",
            refdcp.reference.ReferenceSavePlanner(safe_globals=safe),
        )
        assert ref == fast, (names, allow)
        # A refusal comes before any byte is written; a save that passes commits.
        for where in ("fast", "ref"):
            committed = os.path.exists(f"{d}/{where}/.metadata")
            assert committed == (fast is None), (where, names, allow)
