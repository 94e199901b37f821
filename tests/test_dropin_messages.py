"""What torch code matches on: torch's error wording and io.BytesIO values (API-23, API-24, LOAD-7)."""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import LoadPolicyError
from refdcp.storage.errors import UnsafeObjectError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SAVED = {"a": (2, 3), "b": (4,), "n.c": (1,)}
#: half the profile's examples (ci 12, thorough 200): each property runs once per implementation
HALF = settings(max_examples=max(5, settings().max_examples // 2), deadline=None)
#: torch's sentences for the two problems, as torch 2.13 words them
TORCH_WORDING = re.compile(
    r"Missing key in checkpoint state_dict: \S+\.|Size mismatch between saved .+? for \S+"
)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if "." in k:
            head, tail = k.split(".", 1)
            out.setdefault(head, {})[tail] = v
        else:
            out[k] = v
    return out


@pytest.mark.spec("API-23")
@HALF
@given(
    keep=st.lists(st.sampled_from(sorted(SAVED)), unique=True),
    missing=st.lists(st.sampled_from(["x", "n.y", "zz"]), unique=True),
    grow=st.sets(st.sampled_from(sorted(SAVED))),
    world=st.integers(1, 2),
)
def test_refdcp_reports_torchs_sentence_and_its_own_detail(
    impl: ModuleType,
    tmp_path_factory: pytest.TempPathFactory,
    keep: list[str],
    missing: list[str],
    grow: set[str],
    world: int,
) -> None:
    path = tmp_path_factory.mktemp("ck")
    dcp.save(_nest({k: torch.ones(s) for k, s in SAVED.items()}), checkpoint_id=path, no_dist=True)

    def dest() -> dict[str, Any]:
        flat = {k: torch.zeros(SAVED[k][0] + (k in grow), *SAVED[k][1:]) for k in keep}
        flat |= {k: torch.zeros(1) for k in missing}
        return _nest(flat)

    torch_text = ""
    try:
        dcp.load(dest(), checkpoint_id=path, no_dist=True)
    except CheckpointException as e:  # a BaseException
        torch_text = str(e)
    # torch stops at its first problem; its text quotes the raising source line first
    expected = TORCH_WORDING.findall(torch_text)[-1:]

    def rank(comm: Any) -> str:
        try:
            impl.load(dest(), checkpoint_id=path, comm=comm)
        except CheckpointError as e:
            (failure,) = {f.exception.__class__ for f in e.rank_failures.values()}
            assert failure is LoadPolicyError
            return str(e)
        return ""

    texts = FakeWorld(world).run(rank)
    if not expected:
        assert texts == [""] * world
        return
    problems = len(missing) + len(set(grow) & set(keep))
    for text in texts:
        assert expected[0] in text  # torch's sentence, verbatim
        # every problem at once (POLICY-1), each with refdcp's detail, the checkpoint, the ranks
        assert len(set(TORCH_WORDING.findall(text))) == problems
        assert f"at {path}" in text
        assert f"rank(s) {list(range(world))}" in text
        for k in missing:
            assert f"{k!r} is in the state_dict, not in the checkpoint" in text
        for k in set(grow) & set(keep):
            assert f"{k!r}: shape mismatch" in text


@pytest.mark.spec("API-23")
def test_the_checkpoint_named_survives_the_trip_between_ranks() -> None:
    e = LoadPolicyError(["Missing key in checkpoint state_dict: w."], checkpoint="/ck")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.checkpoint == "/ck" and "at /ck (1 problem" in str(back)


# -- io.BytesIO values --------------------------------------------------------------------------

#: who writes and who reads: torch's DCP or the implementation under test
SIDES = ("refdcp", "torch")


@pytest.mark.spec("API-24", "LOAD-7")
@HALF
@given(
    data=st.binary(max_size=300),
    pos=st.integers(0, 400),
    saver=st.sampled_from(SIDES),
    loader=st.sampled_from(SIDES),
)
def test_bytesio_values_round_trip_across_torch_and_refdcp(
    impl: ModuleType,
    tmp_path_factory: pytest.TempPathFactory,
    data: bytes,
    pos: int,
    saver: str,
    loader: str,
) -> None:
    path = tmp_path_factory.mktemp("bio")
    savers = {"torch": dcp.save, "refdcp": impl.save}
    loaders = {"torch": dcp.load, "refdcp": impl.load}
    value = io.BytesIO(data)
    value.seek(pos)
    savers[saver](
        {"b": value, "n": {"e": io.BytesIO(), "raw": data}}, checkpoint_id=path, no_dist=True
    )
    md = dcp.FileSystemReader(path).read_metadata()
    assert type(md.state_dict_metadata["b"]).__name__ == "BytesStorageMetadata"  # a BYTE_IO item
    out: dict[str, Any] = {"b": None, "n": {"e": None, "raw": None}}
    loaders[loader](out, checkpoint_id=path, no_dist=True)
    assert isinstance(out["b"], io.BytesIO)
    assert out["b"].getvalue() == data and out["b"].tell() == pos
    assert isinstance(out["n"]["e"], io.BytesIO) and out["n"]["e"].getvalue() == b""
    assert out["n"]["raw"] == data


@pytest.mark.spec("LOAD-7")
@pytest.mark.parametrize("n", [1, 5, 1 << 40])
def test_a_pickled_bytes_call_with_a_size_is_refused(tmp_path: Path, n: int) -> None:
    """``bytes()`` is allowed only without an argument: a pickle asking for ``bytes(n)``
    (n zero bytes) is an UnsafeObjectError, never an allocation."""
    # single path: load_object is the default planner's object reader
    from refdcp.planning.load_planner import load_object

    class Sized:
        def __reduce__(self) -> tuple[object, ...]:
            return (bytes, (n,))

    buf = io.BytesIO()
    torch.save(Sized(), buf)
    buf.seek(0)
    with pytest.raises(UnsafeObjectError, match="only bytes\\(\\) with no argument"):
        load_object("k", buf, allow_pickle=False, extra=())
