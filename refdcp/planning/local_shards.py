"""LocalShards: a sharded tensor that needs no process group (spec/planning.md, PLAN-3..5).

A rank states the global shape and the ``(offsets, local_tensor)`` chunks it
holds. It implements torch's checkpointable protocol
(``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), so both refdcp's and torch's default planners save
and load it. It is a tensor *wrapper* (like DTensor): ``size()`` and ``dtype``
describe the global tensor, while arithmetic on it is refused (PLAN-5).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["LocalShards"]


class LocalShards(torch.Tensor):
    """This rank's chunks of a ``global_shape`` tensor (PLAN-3).

    ``chunks`` lists ``(offsets, local_tensor)`` pairs; chunks may be uneven,
    empty (a zero in their shape) or absent. ``dtype`` is needed only when
    there are no chunks. Chunks must lie inside the global shape, must not
    overlap one another and must share one dtype and device (PLAN-4).
    """

    _chunks: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(
        cls,
        global_shape: Sequence[int],
        chunks: Iterable[tuple[Sequence[int], torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LocalShards:
        shape = torch.Size(global_shape)
        pairs = [(torch.Size(off), t) for off, t in chunks]
        dtypes = {t.dtype for _, t in pairs}
        devices = {t.device for _, t in pairs}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"LocalShards chunks mix dtypes {dtypes} or devices {devices}")
        if dtype is None:
            if not pairs:
                raise ValueError("LocalShards without chunks needs dtype=")
            dtype = next(iter(dtypes))
        elif pairs and dtype not in dtypes:
            raise ValueError(f"LocalShards dtype={dtype} differs from the chunks' {dtypes}")
        if device is not None and devices and torch.device(device) not in devices:
            raise ValueError(f"LocalShards device={device} differs from the chunks' {devices}")
        if device is None:
            device = next(iter(devices)) if devices else torch.device("cpu")
        _check_chunks(shape, pairs)
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=torch.device(device)
        )
        r._chunks = pairs
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        if func is torch.ops.aten.new_empty.default:
            # torch's StateDictStager copies a tensor subclass as ``new_empty`` plus its
            # attributes (the chunks): an empty container of that shape (PLAN-14)
            kw = kwargs or {}
            return LocalShards(
                args[1],
                [],
                dtype=kw.get("dtype") or args[0].dtype,
                device=kw.get("device") or args[0].device,
            )
        raise TypeError(
            f"LocalShards is a checkpointing container; operation {func} is not supported "
            "(use .chunks to reach the local tensors)"
        )

    @property
    def chunks(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """The ``(offsets, local_tensor)`` pairs of this rank."""
        return list(self._chunks)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        boxes = [(tuple(o), tuple(t.shape)) for o, t in self._chunks]
        return f"LocalShards(global_shape={tuple(self.shape)}, dtype={self.dtype}, chunks={boxes})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild, (tuple(self.shape), self._chunks, self.dtype))

    # torch's checkpointable protocol -------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        """One SHARD write item per non-empty chunk (PLAN-3); empty chunks hold no data.

        A tensor of zero elements gets one empty item covering it on every rank, so
        that torch's planner, which records only planned chunks, keeps the key
        (PLAN-13); refdcp's planner drops it and records the key without chunks.
        """
        props = TensorProperties(dtype=self.dtype)
        if self.numel() == 0:
            zero = torch.Size([0] * len(self.shape))
            return [
                WriteItem(
                    index=MetadataIndex(fqn, zero),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=zero, sizes=self.shape),
                        properties=props,
                        size=self.shape,
                    ),
                )
            ]
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                    properties=props,
                    size=self.shape,
                ),
            )
            for off, t in self._chunks
            if t.numel() > 0
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes this rank holds, in global coordinates (PLAN-3)."""
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The local tensor whose offsets equal ``index.offset`` (PLAN-3)."""
        hint = index.index
        if hint is not None and 0 <= hint < len(self._chunks):
            off, t = self._chunks[hint]
            if off == index.offset:
                return t
        found = [t for off, t in self._chunks if off == index.offset]
        if found:
            return max(found, key=lambda t: t.numel())
        if self.numel() == 0 and index.offset == torch.Size([0] * len(self.shape)):
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)  # PLAN-13
        raise ValueError(f"LocalShards for {index.fqn!r} has no chunk at offsets {index.offset}")


def _rebuild(
    shape: tuple[int, ...], chunks: list[tuple[torch.Size, torch.Tensor]], dtype: torch.dtype
) -> LocalShards:
    return LocalShards(shape, chunks, dtype=dtype)


def _check_chunks(shape: torch.Size, pairs: list[tuple[torch.Size, torch.Tensor]]) -> None:
    """Chunks in bounds and pairwise disjoint (PLAN-4)."""
    for off, t in pairs:
        if len(off) != len(shape) or t.dim() != len(shape):
            raise ValueError(f"chunk at {tuple(off)} of rank {t.dim()} in a {len(shape)}-d tensor")
        if any(o < 0 or o + s > g for o, s, g in zip(off, t.shape, shape)):
            raise ValueError(
                f"chunk at {tuple(off)} of shape {tuple(t.shape)} exceeds {tuple(shape)}"
            )
    from .metadata.build import find_overlaps  # the sweep the metadata check uses (META-3)

    boxes = [(tuple(off), tuple(t.shape), i) for i, (off, t) in enumerate(pairs) if t.numel() > 0]
    overlaps = find_overlaps(boxes)
    if overlaps:
        a, b = sorted(overlaps[0], key=lambda box: box[0])
        raise ValueError(f"chunks at {a[0]} and {b[0]} overlap")
