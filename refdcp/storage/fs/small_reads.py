"""Small whole-chunk items read in runs: one vectored read per run, one CRC per item (STORE-47).

A checkpoint of many small tensors stores them back to back in a data file.
Items that are adjacent on disk are read with one ``preadv`` per run: each
item's framing bytes land in a scratch buffer and its elements straight in
the destination tensor. Each item's CRC-32C is then checked over its whole
stored range (framing and elements, INTEG-1) before the planner's
``commit_tensor``, as LOAD-10 checks a whole-chunk read; a run holds at most
``PIECE_BYTES`` so the bytes are still in cache when they are checked.

Only reads of a whole saved chunk with refdcp framing (a known data offset)
and below ``INPLACE_MIN_BYTES`` come here, and never with ``verify=True``
(which checks before delivering, INTEG-4). Several items share one read only
for planners whose ``resolve_tensor``/``commit_tensor`` are the default ones
(views of the state dict, nothing to commit); any other planner gets its
items one at a time, ``resolve_tensor`` -> read -> ``commit_tensor``, as
with torch's reader. Destinations that overlap in memory are read one at a
time too, so each item's bytes are checked before the next one lands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner as TorchDefaultLoadPlanner,
)
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from refdcp.errors import RefdcpError
from refdcp.storage.errors import CorruptionError
from refdcp.storage.format.items import raw_view
from refdcp.storage.format.tensor_values import bytes_are_values
from refdcp.storage.fs.checked_read import PIECE_BYTES, scrub

__all__ = ["SmallItem", "batches_items", "read_small_items", "register_default_methods"]

#: iovecs per ``preadv`` (Linux allows 1024); each item takes two.
MAX_IOV = 1020


@dataclass
class SmallItem:
    """One whole-chunk read of an item stored at ``offset`` (its framing is ``data_offset``
    bytes, then ``nbytes`` of elements, then the rest of ``length``)."""

    req: ReadItem
    offset: int
    length: int
    data_offset: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    crc: int | None  # None: read unchecked


#: resolve_tensor/commit_tensor methods known to behave as torch's defaults: torch's own, and
#: those a planner module registers (refdcp's ``DefaultLoadPlanner`` does, on import), so that
#: storage never imports planning (ARCHITECTURE.md's layers)
_DEFAULT_RESOLVE: set[Any] = {TorchDefaultLoadPlanner.resolve_tensor}
_DEFAULT_COMMIT: set[Any] = {TorchDefaultLoadPlanner.commit_tensor}


def register_default_methods(planner_cls: type[LoadPlanner]) -> None:
    """Treat ``planner_cls``'s resolve_tensor/commit_tensor as torch's defaults (STORE-47)."""
    _DEFAULT_RESOLVE.add(planner_cls.resolve_tensor)
    _DEFAULT_COMMIT.add(planner_cls.commit_tensor)


def batches_items(planner: LoadPlanner) -> bool:
    """True for planners whose resolve/commit are refdcp's or torch's defaults (STORE-47)."""
    cls = type(planner)
    resolve, commit = _DEFAULT_RESOLVE, _DEFAULT_COMMIT
    if (
        getattr(cls, "resolve_tensor", None) not in resolve
        or getattr(cls, "commit_tensor", None) not in commit
    ):
        return False
    if isinstance(planner, TorchDefaultLoadPlanner):
        return (
            getattr(cls, "lookup_tensor", None) is TorchDefaultLoadPlanner.lookup_tensor
            and getattr(cls, "transform_tensor", None) is TorchDefaultLoadPlanner.transform_tensor
        )
    return True


def read_small_items(
    fd: int,
    file: str,
    items: list[SmallItem],
    planner: LoadPlanner,
    batch: bool,
    delivered: list[str] | None = None,
) -> None:
    """Deliver ``items`` (sorted by offset) in order, in runs of adjacent items (STORE-47);
    the fqn of each item whose destination got its bytes is appended to ``delivered``."""
    if delivered is None:
        delivered = []
    run: list[SmallItem] = []
    end = -1
    run_bytes = 0
    for item in items:
        if run and (
            not batch
            or item.offset != end
            or len(run) * 2 >= MAX_IOV
            or run_bytes + item.length > PIECE_BYTES
        ):
            _deliver_run(fd, file, run, planner, delivered)
            run, run_bytes = [], 0
        run.append(item)
        end = item.offset + item.length
        run_bytes += item.length
    if run:
        _deliver_run(fd, file, run, planner, delivered)


def _deliver_run(
    fd: int, file: str, run: list[SmallItem], planner: LoadPlanner, delivered: list[str]
) -> None:
    targets = [_resolve(planner, item) for item in run]
    if len(run) > 1 and _overlap(targets):
        for item, target in zip(run, targets):
            _read_and_commit(fd, file, [item], [target], planner, delivered)
        return
    _read_and_commit(fd, file, run, targets, planner, delivered)


def _resolve(planner: LoadPlanner, item: SmallItem) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, tensor the elements are read into): the destination itself when its
    memory holds exactly the stored elements, else a fresh tensor copied in afterwards."""
    target = planner.resolve_tensor(item.req)
    if target.requires_grad:
        target = target.detach()
    if (
        target.device.type == "cpu"
        and target.dtype == item.dtype
        and target.shape == item.sizes
        and bytes_are_values(target)
    ):
        return target, target
    return target, torch.empty(item.sizes, dtype=item.dtype)


def _overlap(targets: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    spans = sorted((t.data_ptr(), t.nbytes) for _, t in targets if t.nbytes)
    return any(a + n > b for (a, n), (b, _) in pairwise(spans))


def _read_and_commit(
    fd: int,
    file: str,
    run: list[SmallItem],
    targets: list[tuple[torch.Tensor, torch.Tensor]],
    planner: LoadPlanner,
    delivered: list[str],
) -> None:
    base = run[0].offset
    total = sum(item.length for item in run)
    scratch = memoryview(bytearray(total - sum(into.nbytes for _, into in targets)))
    # the file holds head, elements, tail of each item back to back: the framing between
    # two items' elements (a tail and the next head) is one span of the scratch buffer
    views: list[memoryview] = []
    parts: list[tuple[memoryview, memoryview, memoryview]] = []
    pos = span = 0
    for item, (_, into) in zip(run, targets):
        data = raw_view(into)
        head_end = pos + item.data_offset
        end = item.length - len(data) + pos
        parts.append((scratch[pos:head_end], data, scratch[head_end:end]))
        if len(data):
            views += (scratch[span:head_end], data)
            span = head_end
        pos = end
    views.append(scratch[span:pos])
    try:
        got = _preadv_all(fd, views, base, total)
    except BaseException:
        _scrub_from(0, run, targets, parts, -1, delivered)
        raise
    for k, (item, (target, into), (head, data, tail)) in enumerate(zip(run, targets, parts)):
        try:
            if got < item.offset - base + item.length:
                raise CorruptionError(
                    "data file truncated",
                    fqn=item.req.storage_index.fqn,
                    file=file,
                    offset=base + got,
                )
            if item.crc is not None:
                crc = crc32c.crc32c(tail, crc32c.crc32c(data, crc32c.crc32c(head)))
                if crc != item.crc:
                    raise CorruptionError(
                        f"checksum mismatch (stored {item.crc:08x}, computed {crc:08x})",
                        fqn=item.req.storage_index.fqn,
                        file=file,
                        offset=item.offset,
                    )
        except BaseException:
            _scrub_from(k, run, targets, parts, got, delivered)
            raise
        if into is not target:
            if target.size() != into.size():
                raise RefdcpError(
                    f"read {item.req.storage_index.fqn}: destination size "
                    f"{tuple(target.size())} != stored size {tuple(into.size())}"
                )
            target.copy_(into)
        delivered.append(item.req.storage_index.fqn)
        planner.commit_tensor(item.req, target)


def _scrub_from(
    first: int,
    run: list[SmallItem],
    targets: list[tuple[torch.Tensor, torch.Tensor]],
    parts: list[tuple[memoryview, memoryview, memoryview]],
    got: int,
    delivered: list[str],
) -> None:
    """After item ``first`` of a run failed its check: zero-fill its destination, and of the
    items after it, which the read already filled in place, keep those that pass their
    check (listed in ``delivered``) and zero-fill the others (LOAD-20); ``got``: the bytes
    the run's read returned (-1: the read itself failed)."""
    base = run[0].offset
    for k in range(first, len(run)):
        item, (target, into), (head, data, tail) = run[k], targets[k], parts[k]
        if into is not target:
            continue  # read into a scratch tensor: the destination was never touched
        whole = got >= item.offset - base + item.length
        ok = k > first and whole
        if ok and item.crc is not None:
            ok = crc32c.crc32c(tail, crc32c.crc32c(data, crc32c.crc32c(head))) == item.crc
        if ok:
            delivered.append(item.req.storage_index.fqn)
        else:
            scrub(data)


def _preadv_all(fd: int, views: list[memoryview], offset: int, total: int) -> int:
    """Fill ``views`` (``total`` bytes) in order from ``offset``; the bytes read (fewer only
    at end of file)."""
    if len(views) <= MAX_IOV:
        got = os.preadv(fd, views, offset)
        if got == total:
            return got
    views = [v for v in views if len(v)]
    done, first = 0, 0
    while first < len(views):
        n = os.preadv(fd, views[first : first + MAX_IOV], offset + done)
        if n == 0:
            break
        done += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]
    return done
