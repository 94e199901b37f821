"""Data checks: bit-exact reads of every dtype, size and shape, bytes, many items, partial reads
(CONF-10..15, CONF-30, CONF-46)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from conformance.checks.common import roundtrip, save_at
from conformance.checks.crossed import explain
from conformance.drive import load_ranks
from conformance.registry import CheckFailed, Context, NotApplicable, backend_error, spec
from conformance.truth import DTYPES, bits, finite_tensor, rand_tensor, special_values


@spec("CONF-10", title="every dtype reads back bit-exact, special values included")
def every_dtype(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(10)
    sd: dict[str, Any] = {}
    caps = ctx.backend.capabilities
    for dt in DTYPES:
        name = str(dt).replace("torch.", "")
        if caps.dtypes is not None and name not in caps.dtypes:  # a profile's limit (CONF-69)
            why = caps.reason("dtypes")
            ctx.notes.append(f"{name} not saved: not among the backend's dtypes ({why})")
            continue
        sd[name] = rand_tensor((5, 7), dt, gen)
        if dt.is_floating_point or dt.is_complex:
            # NaN payloads and signs, +-inf, +-0, subnormals: each a distinct bit pattern.
            sd[f"{name}.special"] = special_values(dt)
    if not sd:
        raise NotApplicable("the backend declares none of the dtypes CONF-10 saves")
    roundtrip(ctx, [sd], "CONF-10")


@spec("CONF-11", title="0-d and zero-size tensors read back exactly")
def degenerate_shapes(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(11)
    sd: dict[str, Any] = {
        "scalar_f32": finite_tensor((), torch.float32, gen),
        "scalar_i64": rand_tensor((), torch.int64, gen),
        "scalar_bool": rand_tensor((), torch.bool, gen),
        "empty_1d": torch.empty((0,), dtype=torch.float32),
        "empty_2d": torch.empty((3, 0), dtype=torch.bfloat16),
        "empty_3d": torch.empty((0, 4, 2), dtype=torch.int32),
    }
    roundtrip(ctx, [sd], "CONF-11")


@spec("CONF-12", title="views and non-contiguous sources save their logical values")
def views(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(12)
    base = finite_tensor((8, 10), torch.float32, gen)
    sd: dict[str, Any] = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "narrow": base.narrow(1, 3, 4),
        "expanded": rand_tensor((1, 6), torch.int16, gen).expand(5, 6),
        "offset_row": base[5],
    }
    roundtrip(ctx, [sd], "CONF-12")


#: (name, dtype, element count) of CONF-46's tensors: byte counts around 4 KiB and
#: 64 KiB, and 6 MiB + 4 bytes, past 1, 2, 4 and 5 MiB part or buffer boundaries.
SIZES: tuple[tuple[str, torch.dtype, int], ...] = (
    ("empty", torch.float32, 0),
    ("one_element", torch.float64, 1),
    ("odd_3_bytes", torch.uint8, 3),
    ("odd_91_int16", torch.int16, 91),
    ("bytes_4095", torch.uint8, 4095),
    ("bytes_4096", torch.float32, 1024),
    ("bytes_4097", torch.uint8, 4097),
    ("bytes_65536", torch.float32, 16384),
    ("bytes_65537", torch.uint8, 65537),
    ("bytes_6MiB_plus_4", torch.float32, 6 * 2**18 + 1),
)


@spec("CONF-46", title="tensors from empty to 6 MiB read back bit-exact")
def sizes(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(46)
    sd: dict[str, Any] = {name: finite_tensor((n,), dt, gen) for name, dt, n in SIZES}
    sd["bytes_65536"] = sd["bytes_65536"].reshape(128, 128)
    roundtrip(ctx, [sd], "CONF-46")


@dataclass(frozen=True)
class Opaque:
    """A picklable object that torch stores as one bytes item (no flattening)."""

    name: str
    values: tuple[int, ...]


@spec(
    "CONF-13",
    title="bytes items (BytesIO and pickled objects) read back exactly",
    needs=("bytes_items",),
)
def bytes_items(ctx: Context) -> None:
    sd: dict[str, Any] = {
        "raw": io.BytesIO(bytes(range(256)) * 3),
        "empty_raw": io.BytesIO(b""),
        "raw_4097": io.BytesIO(bytes(range(251)) * 16 + bytes(81)),
        "raw_65537": io.BytesIO(bytes(range(255, -1, -1)) * 256 + b"\x01"),
        "obj": Opaque("ünïcode", (1, 2, 3)),
        "text": "plain string",
        "number": 42,
        "tensor": torch.arange(6, dtype=torch.float64),
    }
    roundtrip(ctx, [sd], "CONF-13")


@spec("CONF-14", title="many small items read back exactly")
def many_items(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(14)
    sd: dict[str, Any] = {
        f"layer{i:03d}.w": finite_tensor((i % 5 + 1,), torch.float32, gen) for i in range(300)
    }
    roundtrip(ctx, [sd], "CONF-14")


class _PartialPlanner(DefaultLoadPlanner):
    """Loads sub-boxes of saved tensors, as a resharded destination does."""

    def __init__(self, boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> None:
        super().__init__()
        self.boxes = boxes
        self.dest: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, boxes in self.boxes.items():
            md = self.metadata.state_dict_metadata[fqn] if self.metadata else None
            if not isinstance(md, TensorStorageMetadata):
                raise CheckFailed(f"CONF-15: metadata of {fqn!r} is not tensor metadata")
            for offsets, sizes in boxes:
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                self.dest[(fqn, offsets)] = torch.full(sizes, 0, dtype=md.properties.dtype)
                items.extend(create_read_items_for_chunk_list(fqn, md, [chunk]))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        view = dest
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


Boxes = dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]


def _saved_for_boxes(ctx: Context) -> tuple[Any, dict[str, Any]]:
    gen = torch.Generator().manual_seed(15)
    sd: dict[str, Any] = {
        "w": finite_tensor((9, 7), torch.float32, gen),
        "v": rand_tensor((13,), torch.int64, gen),
        "h": finite_tensor((4, 6, 5), torch.bfloat16, gen),
    }
    loc = ctx.location()
    (truth,) = save_at(ctx, loc, [sd])
    return loc, truth


def _load_boxes(ctx: Context, loc: Any, truth: dict[str, Any], boxes: Boxes, req: str) -> None:
    planner = _PartialPlanner(boxes)
    point = "one rank loading " + "; ".join(
        f"{fqn} {tuple(truth[fqn].shape)} boxes " + ", ".join(f"at {o} of {sz}" for o, sz in bx)
        for fqn, bx in boxes.items()
    )
    try:
        load_ranks(
            [ctx.backend.reader(loc)],
            [{k: truth[k] for k in boxes}],
            checkpoint_id=loc,
            planners=[planner],
        )
    except BaseException as exc:
        if not backend_error(exc):
            raise
        # an IndexError or a shape error raised inside torch says nothing on its own (CONF-68)
        raise CheckFailed(
            f"{req}: {point}: the load raised {explain(exc)}; expected exactly "
            "those sub-boxes of the saved tensors"
        ) from exc
    for (fqn, offsets), got in planner.dest.items():
        want = truth[fqn]
        for dim, (start, length) in enumerate(zip(offsets, got.shape, strict=True)):
            want = want.narrow(dim, start, length)
        if bits(got) != bits(want):
            raise CheckFailed(
                f"{req}: {point}: {fqn} box at offsets {offsets} of size {tuple(got.shape)} "
                f"differs from the saved data: read {bits(got)[:8].hex()}..., saved "
                f"{bits(want)[:8].hex()}...; expected the saved sub-box"
            )


@spec("CONF-15", title="partial reads at resharding offsets return the exact sub-boxes")
def partial_reads(ctx: Context) -> None:
    loc, truth = _saved_for_boxes(ctx)
    # One box per tensor per load, as a rank holding one shard of each tensor reads.
    loads: list[Boxes] = [
        {"w": [((0, 0), (4, 7))], "v": [((0,), (5,))], "h": [((1, 2, 1), (2, 3, 4))]},
        {"w": [((4, 0), (5, 7))], "v": [((5,), (8,))], "h": [((0, 0, 0), (4, 6, 5))]},
        {"w": [((2, 3), (5, 2))], "v": [((12,), (1,))]},
        {"w": [((8, 6), (1, 1))]},
    ]
    for boxes in loads:
        _load_boxes(ctx, loc, truth, boxes, "CONF-15")


@spec("CONF-30", title="one plan reading several disjoint boxes of one stored chunk")
def several_boxes_one_plan(ctx: Context) -> None:
    loc, truth = _saved_for_boxes(ctx)
    boxes: Boxes = {
        "w": [((0, 0), (4, 7)), ((4, 0), (5, 7))],
        "v": [((0,), (5,)), ((5,), (7,)), ((12,), (1,))],
        "h": [((0, 0, 0), (2, 6, 5)), ((2, 0, 0), (2, 6, 5))],
    }
    _load_boxes(ctx, loc, truth, boxes, "CONF-30")
