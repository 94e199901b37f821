"""Reliability: what is saved is the tensor's values, never its raw memory (SAVE-10, SAVE-11).

Issue 11 item 4: a conjugate or negative view saved by ``refdcp.save`` stored
the underlying memory (the contiguous fast path took raw bytes) and ``verify``
reported OK. Every path that takes bytes is checked here: the filesystem
writer, the in-memory storage, async_save, checksums (``verify``), and a raw
read into a destination that is itself a view.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given

from refdcp.storage import MemoryStorage
from refdcp.storage.format.tensor_values import bytes_are_values, values_tensor
from refdcp.storage.verify import verify_checkpoint
from tests.strategies import VIEW_KINDS, expected, make_view, tensor_dicts

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _cases() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for kind in VIEW_KINDS:
        for dtype in (torch.complex64, torch.float32):
            out[f"{kind}_{dtype}".replace("torch.", "")] = make_view(kind, dtype, (3, 2), 7)
    out["empty_conj"] = make_view("conj", torch.complex64, (0, 2), 1)
    return out


def _dest(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: torch.full(tuple(v.shape), 7, dtype=v.dtype) for k, v in sd.items()}


def _check(sd: dict[str, torch.Tensor], got: dict[str, Any]) -> None:
    for k, v in sd.items():
        assert torch.equal(got[k], expected(v)), k


@pytest.mark.spec("SAVE-10", "INTEG-3")
def test_views_round_trip_through_the_filesystem_and_verify(
    tmp_path: Path, impl: ModuleType
) -> None:
    sd = _cases()
    assert any(t.is_conj() for t in sd.values()) and any(t.is_neg() for t in sd.values())
    impl.save(dict(sd), checkpoint_id=str(tmp_path), no_dist=True)
    got = _dest(sd)
    impl.load(got, checkpoint_id=str(tmp_path), no_dist=True, verify=True)
    _check(sd, got)
    assert verify_checkpoint(tmp_path).ok
    # torch's own loader reads the same values
    import torch.distributed.checkpoint as tdcp

    theirs = _dest(sd)
    tdcp.load(theirs, checkpoint_id=str(tmp_path))
    _check(sd, theirs)


@pytest.mark.spec("SAVE-10")
def test_views_round_trip_through_memory_storage(impl: ModuleType) -> None:
    sd = _cases()
    store = MemoryStorage()
    impl.save(dict(sd), storage_writer=store.writer("c"), no_dist=True)
    reader = store.reader("c")
    reader.set_verify(True)
    got = _dest(sd)
    impl.load(got, storage_reader=reader, no_dist=True)
    _check(sd, got)


@pytest.mark.spec("SAVE-10")
def test_views_round_trip_through_async_save(tmp_path: Path, impl: ModuleType) -> None:
    # staging deep-copies tensor subclasses, which torch refuses for subclasses without new_empty
    sd = {k: v for k, v in _cases().items() if not k.startswith("subclass")}
    handle = impl.async_save(dict(sd), checkpoint_id=str(tmp_path), no_dist=True)
    handle.result(timeout=60)
    got = _dest(sd)
    impl.load(got, checkpoint_id=str(tmp_path), no_dist=True, verify=True)
    _check(sd, got)


@pytest.mark.spec("SAVE-11")
def test_load_into_a_conjugate_or_negative_view_sets_its_values(
    tmp_path: Path, impl: ModuleType
) -> None:
    """A raw read into a destination whose memory is not its values would flip them."""
    src = {"c": torch.randn(4, dtype=torch.complex64), "n": torch.randn(4)}
    impl.save(dict(src), checkpoint_id=str(tmp_path), no_dist=True)
    dest = {"c": torch.zeros(4, dtype=torch.complex64).conj(), "n": torch.zeros(4)._neg_view()}
    impl.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(dest["c"].resolve_conj(), src["c"])
    assert torch.equal(dest["n"].resolve_neg(), src["n"])


@pytest.mark.spec("SAVE-10")
def test_values_tensor_resolves_every_kind() -> None:
    for name, t in _cases().items():
        v = values_tensor(t)
        assert bytes_are_values(v), name
        assert torch.equal(v, expected(t)), name
    with pytest.raises(ValueError, match="meta"):
        values_tensor(torch.empty(2, device="meta"))


@pytest.mark.spec("SAVE-10")
@given(sd=tensor_dicts())
def test_round_trip_property_over_views(
    tmp_path_factory: pytest.TempPathFactory, sd: dict[str, torch.Tensor], impl: ModuleType
) -> None:
    """Random views of random dtypes round-trip exactly through save/load(verify=True)."""
    path = tmp_path_factory.mktemp("views")
    impl.save(dict(sd), checkpoint_id=str(path), no_dist=True)
    got = _dest(sd)
    impl.load(got, checkpoint_id=str(path), no_dist=True, verify=True)
    _check(sd, got)


@pytest.mark.spec("SAVE-10")
def test_wrapper_subclass_is_saved_as_its_values(tmp_path: Path, impl: ModuleType) -> None:
    """A wrapper subclass (no storage of its own) is stored as the values its copy_ defines."""
    from torch.testing._internal.two_tensor import TwoTensor

    a = torch.randn(3, 2)
    wrapped = TwoTensor(a.clone(), a.clone())
    impl.save({"t": wrapped}, checkpoint_id=str(tmp_path), no_dist=True)
    got: dict[str, Any] = {"t": torch.zeros(3, 2)}
    impl.load(got, checkpoint_id=str(tmp_path), no_dist=True, verify=True)
    assert type(got["t"]) is torch.Tensor and torch.equal(got["t"], a)
