"""Shared steps of the checks: save a state dict, load it back, compare with the truth."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from conformance.drive import Fault, load_ranks, save_ranks
from conformance.registry import (
    CheckFailed,
    Context,
    NotApplicable,
    backend_error,
    describe,
    tick,
)
from conformance.truth import assert_same, blank_like, clone_truth, finite_tensor

__all__ = [
    "baseline_save",
    "blank_dest",
    "committed",
    "load_all",
    "load_error",
    "load_into",
    "rank_sd",
    "read_metadata",
    "roundtrip",
    "sample_sd",
    "save_at",
    "try_save",
    "world",
]


def world(ctx: Context) -> int:
    """Ranks per location: two only for a backend declaring ``shared_location`` (CONF-55)."""
    return 2 if ctx.backend.capabilities.shared_location else 1


def rank_sd(rank: int, seed: int, n: int = 3) -> dict[str, Any]:
    """``sample_sd`` with keys prefixed by the rank, so ranks never collide."""
    return {f"rank{rank}.{k}": v for k, v in sample_sd(seed, n).items()}


def sample_sd(seed: int, n: int = 3) -> dict[str, Any]:
    """A small state dict of tensors of several dtypes, finite values only.

    No bytes item: those belong to CONF-13 alone (CONF-52).
    """
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {}
    dtypes = (torch.float32, torch.int64, torch.bfloat16)
    for i in range(n):
        sd[f"t{i}"] = finite_tensor((3, 4 + i), dtypes[i % len(dtypes)], gen)
    sd["step"] = torch.tensor(seed, dtype=torch.int64)
    return sd


def blank_dest(truth: dict[str, Any]) -> dict[str, Any]:
    """Destinations for a load: fresh tensors unlike the truth; placeholders for bytes."""
    dest: dict[str, Any] = {}
    for k, v in truth.items():
        if isinstance(v, torch.Tensor):
            dest[k] = blank_like(v)
        elif isinstance(v, bytes):
            dest[k] = io.BytesIO()
        else:
            dest[k] = None
    return dest


def save_at(
    ctx: Context, location: Any, sds: Sequence[dict[str, Any]], *, thread_count: int = 1
) -> list[dict[str, Any]]:
    """Save one state dict per rank at ``location``; return the ground truth per rank."""
    truths = [clone_truth(sd) for sd in sds]
    writers = [
        ctx.backend.writer(location, rank=r, thread_count=thread_count) for r in range(len(sds))
    ]
    save_ranks(writers, sds, checkpoint_id=location)
    return truths


def try_save(
    ctx: Context, location: Any, sds: Sequence[dict[str, Any]], fault: Fault | None
) -> BaseException | None:
    """Save with an optional injected fault; return what was raised, or None (CONF-50)."""
    writers = [ctx.backend.writer(location, rank=r) for r in range(len(sds))]
    try:
        save_ranks(writers, sds, checkpoint_id=location, fault=fault)
    except BaseException as exc:
        if not backend_error(exc):
            raise
        return exc
    return None


def baseline_save(ctx: Context, sds: Sequence[dict[str, Any]], requirement: str) -> None:
    """Save ``sds`` without a fault at a fresh location; n/a unless it commits (CONF-53)."""
    loc = ctx.location()
    err = try_save(ctx, loc, sds, None)
    if err is not None:
        raise NotApplicable(
            f"{requirement} cannot be judged: the same save without an injected fault "
            f"fails too: {describe(err)}"
        )
    seen = load_error(ctx, loc)
    if seen is not None:
        raise NotApplicable(
            f"{requirement} cannot be judged: after the same save without an injected fault, "
            f"read_metadata raised {describe(seen)}"
        )


def load_into(
    ctx: Context, location: Any, truths: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Load every rank's keys from ``location`` into blank destinations; return them."""
    dests = [blank_dest(t) for t in truths]
    readers = [ctx.backend.reader(location) for _ in truths]
    load_ranks(readers, dests, checkpoint_id=location)
    return dests


def read_metadata(ctx: Context, location: Any) -> Metadata:
    """What a fresh reader's ``read_metadata`` returns at ``location`` (it may raise)."""
    tick()
    reader = ctx.backend.reader(location)
    reader.reset(location)
    md = reader.read_metadata()
    tick()
    if not isinstance(md, Metadata):
        raise CheckFailed(f"read_metadata returned {type(md).__name__}, not Metadata")
    return md


def load_all(ctx: Context, location: Any, truth: dict[str, Any]) -> dict[str, Any]:
    """Load every key the metadata lists, into blank destinations (``truth`` shapes the
    blanks where it has the key); return the loaded state (CONF-47, CONF-48)."""
    md = read_metadata(ctx, location)
    dest: dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        want = truth.get(key)
        if isinstance(item, TensorStorageMetadata):
            same = (
                isinstance(want, torch.Tensor)
                and tuple(want.shape) == tuple(item.size)
                and want.dtype == item.properties.dtype
            )
            dest[key] = (
                blank_like(want)
                if same and isinstance(want, torch.Tensor)
                else torch.zeros(tuple(item.size), dtype=item.properties.dtype)
            )
        elif isinstance(item, BytesStorageMetadata):
            dest[key] = io.BytesIO()
    load_ranks([ctx.backend.reader(location)], [dest], checkpoint_id=location)
    return dest


def roundtrip(
    ctx: Context, sds: Sequence[dict[str, Any]], requirement: str, *, thread_count: int = 1
) -> None:
    """Save ``sds`` (one per rank) at a fresh location, load back, demand bit-exact equality."""
    loc = ctx.location()
    truths = save_at(ctx, loc, sds, thread_count=thread_count)
    try:
        dests = load_into(ctx, loc, truths)
    except BaseException as exc:
        if not backend_error(exc):
            raise
        raise CheckFailed(f"{requirement}: the load after the save raised {describe(exc)}") from exc
    for dest, truth in zip(dests, truths, strict=True):
        assert_same(dest, truth, requirement)


def load_error(ctx: Context, location: Any) -> BaseException | None:
    """What a fresh reader's ``reset`` + ``read_metadata`` raised at ``location``, or None."""
    try:
        read_metadata(ctx, location)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return exc
    return None


def committed(ctx: Context, location: Any) -> bool:
    """True when a fresh reader finds committed metadata at ``location``."""
    return load_error(ctx, location) is None
