"""Stream transforms: items compressed (or otherwise encoded) by torch's extensions (FMT-23..FMT-27).

torch's ``FileSystemWriter(_extensions=[...])`` passes every item's bytes
through a chain of ``StreamTransformExtension`` objects (``ZStandard`` is the
one torch ships) and records the chain in the item's
``_StorageInfo.transform_descriptors``; its reader rebuilds the chain from the
descriptors through an ``ExtensionRegistry``. This module is refdcp's side of
that format, for :class:`refdcp.storage.filesystem.FileSystemWriter` and
``FileSystemReader``; an item without descriptors never comes here, so the
untransformed paths are unchanged.

The order of the chain (FMT-24): descriptor ``i`` names the transform the
reader undoes ``i``-th, so the first descriptor's ``transform_from`` reads the
stored bytes. The writer's ``_extensions`` are stacked as torch stacks them
(the first one writes into the file, the last one receives the item's bytes),
so the stored bytes are ``e1(e2(...(item)))`` and refdcp records the
descriptors in that same order, ``[e1, e2, ...]``, which is the order both
torch's reader and refdcp's undo them.

Checksums (INTEG-12): ``refdcp_crc32c`` covers the stored (transformed) bytes,
as for every item (INTEG-1), and is checked before any byte is decoded.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlanner,
    ReadItem,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.crc.kernel import crc32c
from refdcp.errors import RefdcpError
from refdcp.storage.errors import CorruptionError, TransformUnavailableError
from refdcp.storage.format.items import (
    CRC_ATTR,
    copy_into_destination,
    encode_bytes,
    encode_tensor,
    narrow,
    verify_blob,
)
from refdcp.storage.format.records import write_result
from refdcp.storage.fs.paths import pread_into

__all__ = [
    "ZSTD_PACKAGE",
    "TransformUnavailableError",
    "WriteTransforms",
    "decode_item",
    "read_transformed_item",
    "write_transformed_items",
    "zstd",
]

#: the zstd binding torch's ``ZStandard`` extension tries first (it falls back to ``pyzstd``);
#: installed by ``pip install refdcp[zstd]``
ZSTD_PACKAGE = "zstandard"
_ZSTD_NAME = "stream.zstd"
#: bytes beyond a tensor chunk's raw size that its decoded framing may take (the torch.save
#: zip records and pickle); a decoded item longer than that is refused, not decoded on (FMT-26)
_FRAMING_ALLOWANCE = 1 << 20
_PIECE = 1 << 20


def _zstd_missing() -> bool:
    from torch.distributed.checkpoint._extension import ZStandard

    return not ZStandard.is_available()


def _install_hint() -> str:
    return (
        f"stream transform {_ZSTD_NAME!r} needs the {ZSTD_PACKAGE!r} package: "
        f"pip install {ZSTD_PACKAGE} (or refdcp[zstd])"
    )


def zstd() -> Any:
    """torch's ``ZStandard`` extension, or :class:`TransformUnavailableError` naming the package
    to install when no zstd binding is there (FMT-25)."""
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        raise TransformUnavailableError(_install_hint())
    return ZStandard()


class _Sink(io.BytesIO):
    """Collects a transform chain's output; closing the chain (which cascades) keeps it."""

    def close(self) -> None:
        pass


class WriteTransforms:
    """The writer's ``_extensions``, checked once (FMT-23)."""

    def __init__(self, extensions: Sequence[Any]) -> None:
        for ex in extensions:
            if not (
                callable(getattr(ex, "transform_to", None))
                and callable(getattr(ex, "get_descriptor", None))
            ):
                raise ValueError(
                    f"_extensions: {type(ex).__name__} is not a stream transform "
                    "(torch's StreamTransformExtension: transform_to and get_descriptor)"
                )
        self.extensions = list(extensions)
        #: in the order a reader undoes them: the first one wrote into the file (FMT-24)
        self.descriptors: list[str] = [str(ex.get_descriptor()) for ex in self.extensions]

    def encode(self, parts: Sequence[Any]) -> bytes:
        """The stored bytes of an item whose untransformed bytes are ``parts``, in order."""
        sink = _Sink()
        stream: IO[bytes] = sink
        for ex in self.extensions:
            stream = ex.transform_to(stream)
        for part in parts:
            if len(part):
                stream.write(part)
        stream.close()  # ends every transform's stream (a zstd frame's last block)
        return sink.getvalue()


def write_transformed_items(
    out: Any,
    name: str,
    items: Sequence[WriteItem],
    planner: SavePlanner,
    transforms: WriteTransforms,
) -> list[WriteResult]:
    """Write ``items`` (BYTE_IO first, as given) through ``transforms`` to ``out`` (FMT-23).

    Each item is encoded as it would be without transforms (FMT-2, FMT-3), then
    transformed in memory and written as one range; its ``_StorageInfo`` has the
    descriptors, the CRC-32C of the stored range (INTEG-12) and no data offset
    (its elements cannot be read in place). The value digest of a tensor
    (DEDUP-17) is that of its untransformed frame, so replicas compare equal
    with or without transforms.
    """
    results: list[WriteResult] = []
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO | bytes):
                raise RefdcpError(f"{item.index.fqn}: BYTE_IO data must be io.BytesIO")
            enc = encode_bytes(data)
        else:
            if not isinstance(data, torch.Tensor):
                raise RefdcpError(f"{item.index.fqn}: tensor item resolved to {type(data)}")
            enc = encode_tensor(data)
        enc.final_crc()  # waits for a helper thread's digest, if one computes it
        stored = transforms.encode(enc.parts)
        offset = out.position
        out.write([stored])
        info = _StorageInfo(name, offset, len(stored), transform_descriptors=transforms.descriptors)
        setattr(info, CRC_ATTR, int(crc32c(stored)))
        results.append(write_result(item.index, len(stored), info, enc.value_crc))
    return results


def decode_item(
    stored: bytes | bytearray | memoryview,
    descriptors: Sequence[str],
    registry: Any,
    fqn: str,
    file: str,
    offset: int,
    limit: int | None = None,
) -> bytes:
    """Undo an item's stream transforms through ``registry`` (torch's ``ExtensionRegistry``).

    A descriptor no extension of ``registry`` claims, or whose package is
    missing, raises :class:`TransformUnavailableError` (FMT-25); bytes a
    transform cannot decode, or a decoded item longer than ``limit``, raise
    ``CorruptionError`` (FMT-26).
    """
    names = [d.partition("/")[0] for d in descriptors]
    if _ZSTD_NAME in names and _zstd_missing():
        raise TransformUnavailableError(f"{fqn} in {file}: {_install_hint()}")
    try:
        extensions = registry.from_descriptor_list(list(descriptors))
    except ValueError as e:
        raise TransformUnavailableError(
            f"{fqn} in {file}: cannot undo stream transforms {list(descriptors)}: {e} "
            "(register the extension in the reader's _extension_registry)"
        ) from e
    stream: IO[bytes] = io.BytesIO(stored)
    for ex in extensions:
        stream = ex.transform_from(stream)
    out = bytearray()
    try:
        while True:
            want = _PIECE if limit is None else min(_PIECE, limit + 1 - len(out))
            piece = stream.read(max(want, 1))
            if not piece:
                break
            out += piece
            if limit is not None and len(out) > limit:
                raise CorruptionError(
                    f"stream transforms {list(descriptors)} decode to more than {limit} bytes",
                    fqn=fqn,
                    file=file,
                    offset=offset,
                )
    except CorruptionError:
        raise
    except Exception as e:  # the transform's own error for bytes it cannot decode
        raise CorruptionError(
            f"stream transforms {list(descriptors)} cannot decode the item: {e}",
            fqn=fqn,
            file=file,
            offset=offset,
        ) from e
    return bytes(out)


def read_transformed_item(
    fd: int,
    relative_path: str,
    req: ReadItem,
    info: Any,
    planner: LoadPlanner,
    chunk: tuple[torch.dtype, tuple[int, ...]] | None,
    registry: Any,
    checked: bool,
) -> None:
    """Read one transformed item: its stored range, checked when ``checked`` (INTEG-12), decoded
    (FMT-24), then delivered as an untransformed item is (``load_bytes``, or a tensor copied
    into its destination, resharded as the read asks)."""
    fqn = req.storage_index.fqn
    byte_io = req.type == LoadItemType.BYTE_IO
    if not byte_io and chunk is None:
        raise RefdcpError(f"{fqn}: chunk {req.storage_index.offset} is not in the metadata")
    blob = bytearray(info.length)
    got = pread_into(fd, memoryview(blob), info.offset)
    if got != info.length:
        raise CorruptionError(
            "data file truncated", fqn=fqn, file=relative_path, offset=info.offset + got
        )
    if checked:
        verify_blob(memoryview(blob), info, fqn, relative_path)
    limit = None
    if chunk is not None:
        dtype, sizes = chunk
        limit = torch.Size(sizes).numel() * dtype.itemsize + _FRAMING_ALLOWANCE
    data = decode_item(
        blob, info.transform_descriptors, registry, fqn, relative_path, info.offset, limit
    )
    del blob
    if byte_io:
        planner.load_bytes(req, io.BytesIO(data))
        return
    loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(loaded, torch.Tensor):
        raise RefdcpError(f"{fqn}: {relative_path} holds {type(loaded)}, not a tensor")
    copy_into_destination(planner, req, narrow(loaded, req.storage_offsets, req.lengths))
