"""Generate ``docs/life-of-a-save.md`` from a real run (TOOL-27).

``python -m refdcp.tools.life_of_a_save`` saves a small model at 4 fake ranks
(``FakeWorld``) with refdcp's default planners into a ``MemoryStorage`` and
loads it back at 3, recording every object at the moment a rank sent or
received it: deep copies taken at the collective, never objects that were
changed later (the coordinator's planner, for one, adds its own plan's digest
to its own plan's ``planner_data`` while it plans). ``--check`` compares the
page with the file instead of writing it.

The output is deterministic: ``MemoryStorage`` names files by generation
(``g1``), and the one random value in a plan, the coordinator planner's token,
is shown as ``<token>``. Every field of the planner's reserved
``planner_data`` entry is explained once, from :data:`FIELDS`; a field that
table does not explain stops the generator (so the freshness test fails).
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from refdcp.api import load, save
from refdcp.comm.base import Communicator
from refdcp.comm.fake import FakeWorld
from refdcp.errors import UnexplainedField
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.planning.load_planner import DefaultLoadPlanner
from refdcp.planning.local_shards import LocalShards
from refdcp.planning.save_planner import DefaultSavePlanner
from refdcp.storage.memory import MemoryStorage, MemoryWriter

__all__ = ["FIELDS", "UnexplainedField", "main", "page_path", "render", "run"]

SAVE_WORLD = 4
LOAD_WORLD = 3

#: Every field of ``planner_data[RESERVED_KEY]`` a local plan carries, explained once.
FIELDS: dict[str, str] = {
    "version": "the format of this record (1).",
    "rich": "FQN -> key path, for the keys torch's path tuples cannot express (an int, "
    "float, bool, bytes or None mapping key, a tuple); empty for a state dict of string "
    "keys and lists (FLAT-3, FLAT-4, FLAT-6).",
    "empties": "the key paths of empty containers, which have no item but are kept (FLAT-2).",
    "digest": "a 16-byte blake2b digest of the plan's item signatures, which lets the "
    "coordinator group ranks with identical plans and dedup them once (DEDUP-8); `None` "
    "in the coordinator's own plan, whose digest it computes only beside other ranks' "
    "plans, in `create_global_plan`.",
    "blocks": "the plan cut into blocks after each item whose FQN's crc32 is 0 modulo "
    "64, with one digest per block, so plans that differ in a few items still share the "
    "dedup of the rest (PLAN-15); `None` in the coordinator's own plan, as `digest`.",
    "deferred_digest": "on the coordinator's plan only, its planner's token: 'my digest "
    "is computed later, by me' (shown as `<token>`; a random value per planner).",
    "checksums": "(FQN, offsets) -> CRC-32C of each value other ranks may also hold, "
    "compared across replicas in the global plan (DEDUP-6, DEDUP-13); tensors are "
    "absent under refdcp's driver, which compares their value digests after the "
    "writes (DEDUP-17); `None` when nothing is checked here.",
    "without_chunks": "sharded values for which this rank plans no chunk, with their dtype "
    "and global shape, so the metadata still describes them (META-1).",
    "deferred_token": "on the coordinator's plan only, its planner's token: 'my "
    "replica checksums come later' (it digests only its items that other ranks hold, "
    "DEDUP-22; shown as `<token>`).",
    "fingerprint": "with plan caching only: a random id naming this structure in the "
    "coordinator's cache (PLAN-9; shown as `<token>`).",
    "cached": "with plan caching only: the id of the cached structure this marker "
    "stands for (PLAN-9; shown as `<token>`).",
}

#: Fields whose value is random per planner or per structure: shown as ``<token>``.
_TOKENS = {"deferred_digest", "deferred_token", "fingerprint", "cached"}


def page_path() -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "life-of-a-save.md"


def model_state(rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s state: an 8 x 4 embedding sharded by rows, a replicated head, a step."""
    rows = 8 // world
    embed = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    lo, hi = rank * rows, 8 if rank == world - 1 else (rank + 1) * rows
    shards = [((lo, 0), embed[lo:hi].clone())]
    return {
        "embed": LocalShards((8, 4), shards),
        "head": {
            "weight": torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16,
            "bias": torch.zeros(4),
        },
        "step": 100,
    }


def empty_state(rank: int, world: int) -> dict[str, Any]:
    state = model_state(rank, world)
    state["embed"] = LocalShards(
        (8, 4), [(o, torch.zeros_like(t)) for o, t in state["embed"].chunks]
    )
    state["head"] = {"weight": torch.zeros(4, 4), "bias": torch.ones(4)}
    state["step"] = 0
    return state


class Record:
    """What each rank sent and received, as deep copies taken at that moment."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.save_local: list[SavePlan] = []
        self.save_final: dict[int, SavePlan] = {}
        self.writes: dict[int, list[WriteResult]] = {}
        self.committed: Metadata | None = None
        self.load_local: list[LoadPlan] = []
        self.load_final: dict[int, LoadPlan] = {}


def _recording_save_planner(rec: Record, rank: int) -> DefaultSavePlanner:
    class Recording(DefaultSavePlanner):
        def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
            rec.save_local = copy.deepcopy(all_plans)  # as the ranks sent them
            return super().create_global_plan(all_plans)

        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            with rec.lock:
                rec.save_final[rank] = copy.deepcopy(new_plan)  # as this rank received it
            return super().finish_plan(new_plan)

    return Recording()


def _recording_writer(rec: Record, store: MemoryStorage, rank: int) -> MemoryWriter:
    class Recording(MemoryWriter):
        def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
            fut = super().write_data(plan, planner)
            results = fut.wait()
            with rec.lock:
                rec.writes[rank] = copy.deepcopy(results)  # as this rank sends them
            return fut

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            super().finish(metadata, results)
            rec.committed = copy.deepcopy(metadata)  # as the coordinator committed it

    w = store.writer("life")
    w.__class__ = Recording
    return w


def _recording_load_planner(rec: Record, rank: int) -> DefaultLoadPlanner:
    class Recording(DefaultLoadPlanner):
        def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
            rec.load_local = copy.deepcopy(global_plan)
            return super().create_global_plan(global_plan)

        def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
            with rec.lock:
                rec.load_final[rank] = copy.deepcopy(central_plan)
            return super().finish_plan(central_plan)

    return Recording()


def run() -> Record:
    """Save at 4 fake ranks, load at 3, and record every plan, result and the metadata."""
    rec = Record()
    store = MemoryStorage()

    def save_rank(comm: Communicator) -> Metadata:
        r = comm.rank
        return save(
            model_state(r, SAVE_WORLD),
            storage_writer=_recording_writer(rec, store, r),
            planner=_recording_save_planner(rec, r),
            comm=comm,
        )

    FakeWorld(SAVE_WORLD).run(save_rank)

    def load_rank(comm: Communicator) -> dict[str, Any]:
        r = comm.rank
        state = empty_state(r, LOAD_WORLD)
        load(
            state,
            storage_reader=store.reader("life"),
            planner=_recording_load_planner(rec, r),
            comm=comm,
        )
        return state

    states = FakeWorld(LOAD_WORLD).run(load_rank)
    for r, state in enumerate(states):
        want = model_state(r, LOAD_WORLD)
        for (_, got), (_, exp) in zip(state["embed"].chunks, want["embed"].chunks, strict=True):
            if not torch.equal(got, exp):
                raise AssertionError(f"rank {r} loaded a wrong embedding shard")
        if not torch.equal(state["head"]["weight"], want["head"]["weight"]):
            raise AssertionError(f"rank {r} loaded a wrong head.weight")
    return rec


def _box(offsets: Any, sizes: Any) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes, strict=True)) + "]"


def _write_item(item: WriteItem) -> str:
    fqn = item.index.fqn
    if item.tensor_data is None:
        return f"`{fqn}` {item.type.name} (torch.save bytes of a Python object)"
    c = item.tensor_data.chunk
    size = list(item.tensor_data.size)
    dtype = str(item.tensor_data.properties.dtype).replace("torch.", "")
    return f"`{fqn}` {item.type.name} {dtype} box {_box(c.offsets, c.sizes)} of {size}"


def _read_item(ri: ReadItem) -> str:
    dest = ri.dest_index
    where = "" if dest.offset is None else f" chunk at {list(dest.offset)}"
    if ri.type.name == "BYTE_IO":
        return f"`{dest.fqn}` BYTE_IO from the saved object"
    return (
        f"`{dest.fqn}`{where}: box {_box(ri.storage_offsets, ri.lengths)} of the saved "
        f"chunk at {list(ri.storage_index.offset or ())} -> box "
        f"{_box(ri.dest_offsets, ri.lengths)} of this rank's chunk"
    )


def _value(name: str, v: Any) -> str:
    if v is None:
        return "`None`"
    if name in _TOKENS:
        return "`<token>`"
    if name == "blocks":
        cuts, digests = v
        return f"cuts after items {list(cuts)}, digests {[d.hex() for d in digests]}"
    if name == "checksums":
        if not v:
            return "`{}`"
        return ", ".join(f"`{k[0]}` {list(k[1] or ())} -> 0x{s:08x}" for k, s in sorted(v.items()))
    if name == "without_chunks" and v:
        return ", ".join(f"`{k}`" for k in sorted(v))
    return f"`{v!r}`"


def _planner_data(pd: Any, seen: set[str], out: list[str]) -> None:
    paths = {k: v for k, v in pd.items() if k != RESERVED_KEY}
    out.append(f"- `planner_data`, torch's part: FQN -> key path: `{paths!r}`")
    reserved = pd.get(RESERVED_KEY, {})
    out.append(f"- `planner_data[{RESERVED_KEY!r}]`, refdcp's part:")
    for name, v in reserved.items():
        if name not in FIELDS:
            raise UnexplainedField(
                f"planner_data field {name!r} is not explained: add it to "
                "refdcp.tools.life_of_a_save.FIELDS"
            )
        first = name not in seen
        seen.add(name)
        note = f" — {FIELDS[name]}" if first else ""
        out.append(f"  - `{name}`: {_value(name, v)}{note}")


def _storage_md(md: Any) -> str:
    if isinstance(md, BytesStorageMetadata):
        return "bytes"
    assert isinstance(md, TensorStorageMetadata)
    chunks = ", ".join(_box(c.offsets, c.sizes) for c in md.chunks)
    dtype = str(md.properties.dtype).replace("torch.", "")
    return f"{dtype} {list(md.size)}, chunks {chunks}"


def render(rec: Record) -> str:
    out = [
        "# The life of a save, as data",
        "",
        "<!-- generated by `python -m refdcp.tools.life_of_a_save`; do not edit by hand -->",
        "",
        "This page is generated from a real run (`refdcp/tools/life_of_a_save.py`;",
        "`tests/test_life_of_a_save.py` fails when it is stale, TOOL-27): a small model",
        f"saved by `refdcp.save` at {SAVE_WORLD} fake ranks (`FakeWorld`) with refdcp's",
        "default planners into a `MemoryStorage`, then loaded at "
        f"{LOAD_WORLD} ranks. Every object is",
        "shown as a rank sent or received it: a deep copy taken at that moment, not the",
        "object after later steps changed it. The storage calls come in the order of",
        "the writer and reader contracts of `spec/protocol.md`.",
        "",
        "The model, on every rank: `embed`, an 8 x 4 float32 tensor sharded by rows",
        "(`LocalShards`, two rows per rank at 4 ranks); `head.weight` (4 x 4) and",
        "`head.bias` (4), which every rank holds in full; `step`, a Python int.",
        "`MemoryStorage` names files by the save's generation (`g1`) where the",
        "filesystem writer puts a random hex token (STORE-2, STORE-22).",
        "",
        "## 1. Local plans, as each rank sent them",
        "",
        "Each rank's `create_local_plan`, then its writer's `prepare_local_plan`,",
        "gathered to the coordinator (SAVE-2). One write item per chunk the rank holds",
        "(PLAN-1); `planner_data` carries the structure and the replica check's data.",
        "",
    ]
    seen: set[str] = set()
    for r, plan in enumerate(rec.save_local):
        out.append(f"### Rank {r}{' (coordinator)' if r == 0 else ''}")
        out.append("")
        out.extend(f"- item: {_write_item(it)}" for it in plan.items)
        _planner_data(plan.planner_data, seen, out)
        out.append("")
    unused = sorted(set(FIELDS) - seen - {"fingerprint", "cached"})
    if unused:
        raise UnexplainedField(f"FIELDS explains fields no plan carries: {unused}")
    out += [
        "## 2. Global plans after dedup, as each rank received them",
        "",
        "The coordinator's `create_global_plan` keeps one writer per replicated item",
        "(DEDUP-1, DEDUP-2), then its writer's `prepare_global_plan` names each",
        "rank's files (`storage_data`); plan `i` is scattered to rank `i` (SAVE-3).",
        "",
    ]
    for r in sorted(rec.save_final):
        plan = rec.save_final[r]
        out.append(f"### Rank {r}")
        out.append("")
        out.extend(f"- item: {_write_item(it)}" for it in plan.items)
        out.append(f"- `storage_data`: `{plan.storage_data!r}`")
        out.append(f"- `planner_data`: `{plan.planner_data!r}`")
        out.append("")
    out += [
        "## 3. Write results, as each rank sent them",
        "",
        "`write_data`'s results, gathered to the coordinator with the value digests",
        "of DEDUP-17 (SAVE-5). `refdcp_crc32c` is the item's checksum (INTEG-1);",
        "`refdcp_value_crc32c` travels to the coordinator only (STORE-52).",
        "",
    ]
    for r in sorted(rec.writes):
        out.append(f"### Rank {r}")
        out.append("")
        for wr in rec.writes[r]:
            info = wr.storage_data
            extra = {
                k: v
                for k, v in vars(wr).items()
                if k not in ("index", "size_in_bytes", "storage_data")
            }
            sd = {k: v for k, v in vars(info).items()}
            out.append(
                f"- `{wr.index.fqn}` {list(wr.index.offset or ())}: {wr.size_in_bytes} B, "
                f"storage `{sd!r}`" + (f", extra `{extra!r}`" if extra else "")
            )
        out.append("")
    md = rec.committed
    assert md is not None
    out += [
        "## 4. The metadata, as committed",
        "",
        "What the coordinator's `finish` committed (SAVE-6) and every rank returned",
        "(SAVE-8).",
        "",
        "`state_dict_metadata`:",
        "",
    ]
    out.extend(f"- `{k}`: {_storage_md(v)}" for k, v in md.state_dict_metadata.items())
    out += ["", "`storage_data` (where each chunk is stored):", ""]
    for idx, info in md.storage_data.items():
        out.append(
            f"- `{idx.fqn}` {list(idx.offset or ())} -> `{info.relative_path}` "
            f"@ {info.offset} +{info.length} B, crc32c "
            f"0x{getattr(info, 'refdcp_crc32c', 0):08x}"
        )
    out += [
        "",
        f"`planner_data`: `{md.planner_data!r}`",
        "",
        f"`storage_meta`: `{md.storage_meta!r}`; `version`: `{md.version!r}`",
        "",
        f"## 5. A load at {LOAD_WORLD} ranks: read plans",
        "",
        "Each rank asks for its own rows of `embed` (rank 2 holds the last four);",
        "the load planner intersects them with the saved chunks (RESHARD-1,",
        "RESHARD-2). Plans as each rank received them from the coordinator (LOAD-3).",
        "",
    ]
    for r in sorted(rec.load_final):
        out.append(f"### Rank {r}")
        out.append("")
        out.extend(f"- read: {_read_item(ri)}" for ri in rec.load_final[r].items)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render(run())
    if "--check" in args:
        if page_path().read_text(encoding="utf-8") != text:
            print(f"{page_path()} is stale: run python -m refdcp.tools.life_of_a_save")
            return 1
        return 0
    page_path().write_text(text, encoding="utf-8")
    print(f"wrote {page_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
