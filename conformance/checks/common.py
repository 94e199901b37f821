"""Shared steps of the checks: save a state dict, load it back, compare with the truth."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from conformance.drive import load_ranks, save_ranks
from conformance.registry import CheckFailed, Context
from conformance.truth import assert_same, blank_like, clone_truth, rand_tensor

__all__ = ["blank_dest", "committed", "load_into", "rank_sd", "roundtrip", "sample_sd", "save_at"]


def rank_sd(rank: int, seed: int, n: int = 3) -> dict[str, Any]:
    """``sample_sd`` with keys prefixed by the rank, so ranks never collide."""
    return {f"rank{rank}.{k}": v for k, v in sample_sd(seed, n).items()}


def sample_sd(seed: int, n: int = 3) -> dict[str, Any]:
    """A small mixed state dict: tensors of several dtypes and one bytes item."""
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {}
    dtypes = (torch.float32, torch.int64, torch.bfloat16)
    for i in range(n):
        sd[f"t{i}"] = rand_tensor((3, 4 + i), dtypes[i % len(dtypes)], gen)
    sd["extra"] = io.BytesIO(bytes([seed % 256]) * 17)
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


def load_into(
    ctx: Context, location: Any, truths: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Load every rank's keys from ``location`` into blank destinations; return them."""
    dests = [blank_dest(t) for t in truths]
    readers = [ctx.backend.reader(location) for _ in truths]
    load_ranks(readers, dests, checkpoint_id=location)
    return dests


def roundtrip(
    ctx: Context, sds: Sequence[dict[str, Any]], requirement: str, *, thread_count: int = 1
) -> None:
    """Save ``sds`` (one per rank) at a fresh location, load back, demand bit-exact equality."""
    loc = ctx.location()
    truths = save_at(ctx, loc, sds, thread_count=thread_count)
    try:
        dests = load_into(ctx, loc, truths)
    except CheckFailed:
        raise
    except Exception as exc:
        raise CheckFailed(f"{requirement}: load failed: {type(exc).__name__}: {exc}") from exc
    for dest, truth in zip(dests, truths, strict=True):
        assert_same(dest, truth, requirement)


def committed(ctx: Context, location: Any) -> bool:
    """True when a fresh reader finds committed metadata at ``location``."""
    reader = ctx.backend.reader(location)
    try:
        reader.reset(location)
        reader.read_metadata()
    except Exception:
        return False
    return True
