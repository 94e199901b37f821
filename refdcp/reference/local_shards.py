"""``LocalShards``, written to be read: a sharded tensor that needs no process group
(PLAN-3..5, REF-16).

A rank names the global shape and the ``(offsets, local_tensor)`` chunks it holds.
The class speaks torch's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), so refdcp's planners, the
reference's and torch's default ones all save and load it. Like a DTensor it wraps
tensors: ``size()`` and ``dtype`` describe the global tensor, arithmetic is refused
(PLAN-5). It means what ``refdcp.LocalShards`` means, with a plain pairwise
overlap check.
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
    """This rank's chunks of a ``global_shape`` tensor (PLAN-3, PLAN-4).

    ``chunks`` lists ``(offsets, local_tensor)`` pairs: uneven, empty (a zero in the
    shape) or none at all, when ``dtype=`` must be given. The chunks lie inside the
    global shape, do not overlap and share one dtype and device (PLAN-4).
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
        pairs = [(torch.Size(offsets), t) for offsets, t in chunks]
        dtypes = {t.dtype for _, t in pairs}
        devices = {t.device for _, t in pairs}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"LocalShards chunks mix dtypes {dtypes} or devices {devices}")
        if dtype is None and not pairs:
            raise ValueError("LocalShards without chunks needs dtype=")
        if dtype is None:
            dtype = pairs[0][1].dtype
        elif pairs and dtype not in dtypes:
            raise ValueError(f"LocalShards dtype={dtype} differs from the chunks' {dtypes}")
        if device is not None and devices and torch.device(device) not in devices:
            raise ValueError(f"LocalShards device={device} differs from the chunks' {devices}")
        if device is None:
            device = pairs[0][1].device if pairs else torch.device("cpu")
        _check_chunks(shape, pairs)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=torch.device(device)
        )
        wrapper._chunks = pairs
        return wrapper

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.new_empty.default:
            # torch's StateDictStager copies a tensor subclass as new_empty plus its
            # attributes (the chunks): an empty LocalShards of that shape (PLAN-14)
            kw = kwargs or {}
            dtype = kw.get("dtype") or args[0].dtype
            return cls(args[1], [], dtype=dtype, device=kw.get("device") or args[0].device)
        raise TypeError(
            f"LocalShards is a checkpointing container; operation {func} is not supported "
            "(use .chunks to reach the local tensors)"
        )

    @property
    def chunks(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """The ``(offsets, local_tensor)`` pairs of this rank (PLAN-3)."""
        return list(self._chunks)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        boxes = [(tuple(o), tuple(t.shape)) for o, t in self._chunks]
        return f"LocalShards(global_shape={tuple(self.shape)}, dtype={self.dtype}, chunks={boxes})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild, (tuple(self.shape), self._chunks, self.dtype))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        """One SHARD item per non-empty chunk (PLAN-3); a tensor of no elements gets one
        empty item covering it, so that torch's planner records the key (PLAN-13)."""
        props = TensorProperties(dtype=self.dtype)
        if self.numel() == 0:
            boxes = [(torch.Size([0] * len(self.shape)), self.shape)]
        else:
            boxes = [(off, t.shape) for off, t in self._chunks if t.numel() > 0]
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=props,
                    size=self.shape,
                ),
            )
            for offsets, sizes in boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes this rank holds, in global coordinates (PLAN-3)."""
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The local tensor at ``index.offset``, the largest if an empty one shares it (PLAN-3)."""
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
    """Every chunk inside ``shape``, no two non-empty chunks sharing an element (PLAN-4)."""
    for off, t in pairs:
        if len(off) != len(shape) or t.dim() != len(shape):
            raise ValueError(f"chunk at {tuple(off)} of rank {t.dim()} in a {len(shape)}-d tensor")
        if any(o < 0 or o + s > g for o, s, g in zip(off, t.shape, shape)):
            raise ValueError(
                f"chunk at {tuple(off)} of shape {tuple(t.shape)} exceeds {tuple(shape)}"
            )
    boxes = sorted((tuple(off), tuple(t.shape)) for off, t in pairs if t.numel() > 0)
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(a_off, a_size, b_off, b_size)):
                raise ValueError(f"chunks at {a_off} and {b_off} overlap")
