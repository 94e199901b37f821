"""Generate ``docs/life-of-a-save.md`` from a real reference run (TOOL-27).

``python -m refdcp.tools.life_of_a_save`` saves a small model at 4 fake ranks
(``FakeWorld``) with ``refdcp.reference.save`` into a real temporary directory
and loads it back at 3 with ``refdcp.reference.load``, recording every object
at the moment a rank sent or received it: deep copies taken at the collective,
never objects that were changed later. It then runs the same save and load
through the default path (``refdcp.save``/``refdcp.load``, its planners and its
filesystem writer) and computes what that path does differently: the fields
its plans carry, the files it writes and their framing. ``--check`` compares
the page with the file instead of writing it.

The output is deterministic: the temporary directory is shown as ``<dir>``,
each save's random file token as ``<token>``, and every other random value (a
planner's token, the ``.metadata`` trailer's CRC, which covers the path) as
``<token>`` or ``<n>``. Every field of the planner's reserved ``planner_data``
entry is explained once, from :data:`FIELDS` (the reference's) and
:data:`DEFAULT_FIELDS` (the ones only the default path sends); a field those
tables do not explain stops the generator (so the freshness test fails).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import refdcp
import refdcp.reference
from refdcp.comm.base import Communicator
from refdcp.comm.fake import FakeWorld
from refdcp.errors import UnexplainedField
from refdcp.planning.load_planner import DefaultLoadPlanner
from refdcp.planning.local_shards import LocalShards
from refdcp.planning.save_planner import DefaultSavePlanner
from refdcp.reference import (
    ReferenceLoadPlanner,
    ReferenceSavePlanner,
    ReferenceWriter,
)
from refdcp.reference.format import METADATA, TRAILER
from refdcp.tools.trace import archive_entries, file_layout, read_checkpoint_files

__all__ = [
    "DEFAULT_FIELDS",
    "FIELDS",
    "PathRun",
    "Record",
    "UnexplainedField",
    "main",
    "page_path",
    "render",
    "run",
]

SAVE_WORLD = 4
LOAD_WORLD = 3

#: The planner's reserved ``planner_data`` entry (FLAT-6); both paths use this key.
RESERVED_KEY = "__refdcp_planner__"

#: Every field of ``planner_data[RESERVED_KEY]`` a reference local plan carries, explained once.
FIELDS: dict[str, str] = {
    "version": "the format of this record (1).",
    "rich": "FQN -> key path, for the keys torch's path tuples cannot express (an int, "
    "float, bool, bytes or None mapping key, a tuple); empty for a state dict of string "
    "keys and lists (FLAT-3, FLAT-4, FLAT-6).",
    "empties": "the key paths of empty containers, which have no item but are kept (FLAT-2).",
    "without_chunks": "sharded values for which this rank plans no chunk, with their dtype "
    "and global shape, so the metadata still describes them (META-1).",
    "checksums": "(FQN, offsets) -> CRC-32C of the value of every item this rank plans; "
    "the coordinator compares them across the ranks that hold the same item, and a "
    "replica whose value differs is refused (DEDUP-6, DEDUP-13).",
}

#: Fields only the default path's planner sends, explained once (in the last section).
DEFAULT_FIELDS: dict[str, str] = {
    "digest": "a 16-byte blake2b digest of the plan's item signatures, which lets the "
    "coordinator group ranks with identical plans and dedup them once (DEDUP-8); `None` "
    "in the coordinator's own plan, whose digest it computes only beside other ranks' "
    "plans, in `create_global_plan`.",
    "blocks": "the plan cut into blocks after each item whose FQN's crc32 is 0 modulo "
    "64, with one digest per block, so plans that differ in a few items still share the "
    "dedup of the rest (PLAN-15); `None` in the coordinator's own plan, as `digest`.",
    "deferred_digest": "on the coordinator's plan only, its planner's token: 'my digest "
    "is computed later, by me' (shown as `<token>`; a random value per planner).",
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


@dataclass
class PathRun:
    """One path's save and load: what each rank sent and received, and the files on disk."""

    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    save_local: list[SavePlan] = field(default_factory=list)
    save_final: dict[int, SavePlan] = field(default_factory=dict)
    writes: dict[int, list[WriteResult]] = field(default_factory=dict)
    committed: Metadata | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    directory: str = ""
    load_local: list[LoadPlan] = field(default_factory=list)
    load_final: dict[int, LoadPlan] = field(default_factory=dict)

    def token(self) -> str:
        """The save's random token, which names its data files (STORE-2)."""
        assert self.committed is not None and self.committed.storage_meta is not None
        return str(self.committed.storage_meta.save_id)

    def mask(self, text: str) -> str:
        """``text`` with this run's random directory and token replaced by placeholders."""
        return text.replace(self.directory, "<dir>").replace(self.token(), "<token>")


@dataclass
class Record:
    """The reference run the page shows, and the default run it is compared with."""

    reference: PathRun
    default: PathRun


def _recording_save_planner(rec: PathRun, rank: int, base: type[Any]) -> Any:
    class Recording(base):  # type: ignore[misc]
        def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
            rec.save_local = copy.deepcopy(all_plans)  # as the ranks sent them
            return super().create_global_plan(all_plans)

        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            with rec.lock:
                rec.save_final[rank] = copy.deepcopy(new_plan)  # as this rank received it
            result: SavePlan = super().finish_plan(new_plan)
            return result

    return Recording()


def _recording_load_planner(rec: PathRun, rank: int, base: type[Any]) -> Any:
    class Recording(base):  # type: ignore[misc]
        def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
            rec.load_local = copy.deepcopy(global_plan)
            result: list[LoadPlan] = super().create_global_plan(global_plan)
            return result

        def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
            with rec.lock:
                rec.load_final[rank] = copy.deepcopy(central_plan)
            result: LoadPlan = super().finish_plan(central_plan)
            return result

    return Recording()


class _RecordingWriter(ReferenceWriter):
    """The reference writer, recording each rank's write results and the committed metadata."""

    def __init__(self, path: str, rec: PathRun, rank: int) -> None:
        super().__init__(path)
        self.rec, self.rec_rank = rec, rank

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        with self.rec.lock:
            self.rec.writes[self.rec_rank] = copy.deepcopy(fut.wait())  # as this rank sends them
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.rec.committed = copy.deepcopy(metadata)  # as the coordinator committed it


def _check_loaded(states: list[dict[str, Any]]) -> None:
    for r, state in enumerate(states):
        want = model_state(r, LOAD_WORLD)
        for (_, got), (_, exp) in zip(state["embed"].chunks, want["embed"].chunks, strict=True):
            if not torch.equal(got, exp):
                raise AssertionError(f"rank {r} loaded a wrong embedding shard")
        if not torch.equal(state["head"]["weight"], want["head"]["weight"]):
            raise AssertionError(f"rank {r} loaded a wrong head.weight")
        if state["step"] != 100:
            raise AssertionError(f"rank {r} loaded a wrong step")


def _run_reference(directory: str) -> PathRun:
    rec = PathRun("reference", directory=directory)

    def save_rank(comm: Communicator) -> Metadata:
        r = comm.rank
        metadata: Metadata = refdcp.reference.save(
            model_state(r, SAVE_WORLD),
            storage_writer=_RecordingWriter(directory, rec, r),
            planner=_recording_save_planner(rec, r, ReferenceSavePlanner),
            comm=comm,
        )
        return metadata

    FakeWorld(SAVE_WORLD).run(save_rank)
    rec.files = read_checkpoint_files(directory)

    def load_rank(comm: Communicator) -> dict[str, Any]:
        state = empty_state(comm.rank, LOAD_WORLD)
        refdcp.reference.load(
            state,
            checkpoint_id=directory,
            planner=_recording_load_planner(rec, comm.rank, ReferenceLoadPlanner),
            comm=comm,
        )
        return state

    _check_loaded(FakeWorld(LOAD_WORLD).run(load_rank))
    return rec


def _run_default(directory: str) -> PathRun:
    rec = PathRun("default", directory=directory)

    def save_rank(comm: Communicator) -> Metadata:
        md: Metadata = refdcp.save(
            model_state(comm.rank, SAVE_WORLD),
            checkpoint_id=directory,
            planner=_recording_save_planner(rec, comm.rank, DefaultSavePlanner),
            comm=comm,
        )
        return md

    rec.committed = FakeWorld(SAVE_WORLD).run(save_rank)[0]
    rec.files = read_checkpoint_files(directory)

    def load_rank(comm: Communicator) -> dict[str, Any]:
        state = empty_state(comm.rank, LOAD_WORLD)
        refdcp.load(
            state,
            checkpoint_id=directory,
            planner=_recording_load_planner(rec, comm.rank, DefaultLoadPlanner),
            comm=comm,
        )
        return state

    _check_loaded(FakeWorld(LOAD_WORLD).run(load_rank))
    return rec


def run() -> Record:
    """Save at 4 fake ranks and load at 3, through the reference and then the default path."""
    with tempfile.TemporaryDirectory(prefix="life-") as ref_dir:
        reference = _run_reference(ref_dir)
    with tempfile.TemporaryDirectory(prefix="life-") as default_dir:
        default = _run_default(default_dir)
    return Record(reference, default)


# --- rendering ------------------------------------------------------------------------------


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
        return ", ".join(f"`{k[0]}` {list(k[1] or ())} -> 0x{s:08x}" for k, s in v.items())
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


def _item_labels(run: PathRun) -> dict[str, list[tuple[int, int, str]]]:
    """File -> (offset, length, label) of every item the committed metadata places there."""
    md = run.committed
    assert md is not None
    out: dict[str, list[tuple[int, int, str]]] = {}
    for idx, info in md.storage_data.items():
        kind = md.state_dict_metadata[idx.fqn]
        what = "object" if isinstance(kind, BytesStorageMetadata) else "tensor chunk"
        label = f"`{idx.fqn}` {list(idx.offset or ())} ({what})"
        out.setdefault(info.relative_path, []).append((info.offset, info.length, label))
    return out


def _files(run: PathRun) -> list[str]:
    """Each file the save left, with the layout of its bytes (STORE-2, STORE-50, FMT-1..4)."""
    out: list[str] = []
    labels = _item_labels(run)
    for name, data in run.files.items():
        shown = run.mask(name)
        if name in labels:
            out.append(f"- `{shown}`, {len(data)} B:")
            out.extend(f"  - {line}" for line in file_layout(data, labels[name]))
        elif name == METADATA:
            head, _, trailer = data.rpartition(TRAILER)
            ok = trailer[:8] == b"%08x" % crc32c.crc32c(head) and trailer[8:] == b"\n"
            out.append(
                "- `.metadata`, `<n>` B (the pickle holds the directory's path): "
                f"`pickle.dumps(Metadata)` (protocol {data[1]}, first bytes "
                f"`{data[:2].hex(' ')}`), then the trailer `#refdcp-crc32c:<crc>\\n`, "
                + ("the CRC-32C of the pickle" if ok else "NOT the CRC-32C of the pickle")
                + " in 8 hex digits (FMT-1, INTEG-2); the commit point is its rename onto "
                "this name (STORE-1, STORE-4)"
            )
        else:
            out.append(f"- `{shown}`, {len(data)} B")
    return out


def _framing(run: PathRun) -> list[str]:
    """The archive entries of each stored tensor chunk and object, once per distinct kind."""
    md = run.committed
    assert md is not None
    shown: dict[str, list[str]] = {}
    for idx, info in md.storage_data.items():
        blob = run.files[info.relative_path][info.offset : info.offset + info.length]
        entries = archive_entries(blob)
        key = ", ".join(f"`{e}`" for e in entries)
        shown.setdefault(key, []).append(f"`{idx.fqn}` {list(idx.offset or ())}")
    return [f"- {', '.join(items)}: zip entries {key}" for key, items in shown.items()]


def _local_plans(run: PathRun, out: list[str]) -> set[str]:
    seen: set[str] = set()
    for r, plan in enumerate(run.save_local):
        out.append(f"### Rank {r}{' (coordinator)' if r == 0 else ''}")
        out.append("")
        out.extend(f"- item: {_write_item(it)}" for it in plan.items)
        _planner_data(plan.planner_data, seen, out)
        out.append("")
    return seen


def _differences(ref: PathRun, dft: PathRun) -> list[str]:
    """The section comparing the two runs: every line computed from both records."""
    out = [
        "## 7. What the default path does differently",
        "",
        "The same save and load through `refdcp.save` and `refdcp.load` (refdcp's default",
        "planners and `FileSystemWriter`, the fast path of `refdcp/driver/`), recorded the",
        "same way and compared with the reference run above. Every line below is computed",
        "from the two runs.",
        "",
        "### Local plans: the fields of the reserved `planner_data` entry",
        "",
        "| field | reference sends | default sends |",
        "|---|---|---|",
    ]
    ref_fields = {k for p in ref.save_local for k in p.planner_data[RESERVED_KEY]}
    dft_fields = {k for p in dft.save_local for k in p.planner_data[RESERVED_KEY]}
    order = list(FIELDS) + [k for k in DEFAULT_FIELDS if k not in FIELDS]
    for name in [*order, *sorted((ref_fields | dft_fields) - set(order))]:
        if name not in ref_fields and name not in dft_fields:
            continue
        if name not in FIELDS and name not in DEFAULT_FIELDS:
            raise UnexplainedField(
                f"planner_data field {name!r} is not explained: add it to "
                "refdcp.tools.life_of_a_save.DEFAULT_FIELDS"
            )
        yes = {True: "yes", False: "no"}
        out.append(f"| `{name}` | {yes[name in ref_fields]} | {yes[name in dft_fields]} |")
    out += ["", "The fields only the default path sends:", ""]
    for name in DEFAULT_FIELDS:
        if name in dft_fields and name not in ref_fields:
            out.append(f"- `{name}`: {DEFAULT_FIELDS[name]}")
    out += [
        "",
        "The plan digests each rank of the default path sent, and its replica checksums:",
        "",
    ]
    for r, plan in enumerate(dft.save_local):
        rec = plan.planner_data[RESERVED_KEY]
        parts = [f"`{n}` {_value(n, rec[n])}" for n in ("digest", "blocks") if n in rec]
        sums = rec.get("checksums")
        ref_sums = ref.save_local[r].planner_data[RESERVED_KEY].get("checksums") or {}
        if "checksums" in rec:
            parts.append(
                f"checksums of {len(sums or {})} item(s) (the reference: {len(ref_sums)}): "
                + _value("checksums", sums)
            )
        out.append(f"- rank {r}: " + "; ".join(parts))
    out += [
        "",
        "### Global plans: how each rank learns its file",
        "",
        "| rank | reference `storage_data` | default `storage_data` |",
        "|---|---|---|",
    ]
    for r in sorted(ref.save_final):
        a = ref.mask(_storage_data(ref.save_final[r].storage_data))
        b = dft.mask(_storage_data(dft.save_final[r].storage_data))
        out.append(f"| {r} | `{a}` | `{b}` |")
    same_items = all(
        [it.index for it in ref.save_final[r].items] == [it.index for it in dft.save_final[r].items]
        for r in ref.save_final
    )
    out += [
        "",
        "Both keep the same writer for every item after dedup: "
        + ("yes." if same_items else "NO, they differ."),
        "",
        "### Files on disk",
        "",
        "| reference file | bytes | default file | bytes |",
        "|---|---|---|---|",
    ]
    for (a, da), (b, db) in zip(ref.files.items(), dft.files.items(), strict=False):
        size_a = "`<n>`" if a == METADATA else str(len(da))
        size_b = "`<n>`" if b == METADATA else str(len(db))
        out.append(f"| `{ref.mask(a)}` | {size_a} | `{dft.mask(b)}` | {size_b} |")
    ref_token, dft_token = ref.token(), dft.token()
    out += [
        "",
        f"The file token: {len(ref_token)} hex digits in the reference, "
        f"{len(dft_token)} in the default path (STORE-2).",
        "",
        "### Framing of each stored item",
        "",
        "Where each item lies, in both:",
        "",
        "| item | reference: file @ offset +length | default: file @ offset +length |",
        "|---|---|---|",
    ]
    assert ref.committed is not None and dft.committed is not None
    for idx, info in ref.committed.storage_data.items():
        other = dft.committed.storage_data.get(idx)
        b = "absent" if other is None else _where(dft, other)
        out.append(f"| `{idx.fqn}` {list(idx.offset or ())} | {_where(ref, info)} | {b} |")
    out += ["", "The zip entries of each stored item, reference:", "", *_framing(ref)]
    out += ["", "and default:", "", *_framing(dft)]
    out += ["", "The default path's files, byte by byte:", "", *_files(dft)]
    out += ["", "### The committed metadata", ""]
    checks = [
        (
            "`state_dict_metadata` (keys, dtypes, shapes, chunks)",
            dict(ref.committed.state_dict_metadata) == dict(dft.committed.state_dict_metadata),
        ),
        ("`planner_data`", ref.committed.planner_data == dft.committed.planner_data),
        (
            "`storage_data` keys (every stored item)",
            set(ref.committed.storage_data) == set(dft.committed.storage_data),
        ),
        ("`version`", ref.committed.version == dft.committed.version),
    ]
    out += [f"- {what}: {'the same' if same else 'DIFFERENT'}" for what, same in checks]
    out += [
        f"- `storage_meta`: reference `{ref.mask(repr(ref.committed.storage_meta))}`, "
        f"default `{dft.mask(repr(dft.committed.storage_meta))}`",
        "",
        "### The load",
        "",
    ]
    diffs: dict[str, list[tuple[Any, Any]]] = {}
    count = 0
    for r in sorted(ref.load_final):
        pairs = zip(ref.load_final[r].items, dft.load_final[r].items, strict=True)
        for ra, rb in pairs:
            count += 1
            for name, va, vb in _field_diffs(ra, rb):
                diffs.setdefault(name, []).append((va, vb))
    if not diffs:
        out.append(f"The {count} read items the ranks received are the same in both paths.")
    else:
        out += [
            f"The {count} read items the ranks received are the same in both paths but for",
            "these fields:",
            "",
        ]
        for name, values in diffs.items():
            va, vb = values[0]
            out.append(
                f"- `{name}`, in {len(values)} of {count} items (e.g. reference `{va!r}`, "
                f"default `{vb!r}`)" + _WHY.get(name, "")
            )
    return out


#: Why a read item's field differs between the paths, where a reason is known.
_WHY = {
    "storage_index.index": ": the default planner fills in the saved chunk's position in "
    "the metadata's chunk list, a hint that spares the reader a search; the reference "
    "leaves it `None` and looks the chunk up by its offsets (torch's `MetadataIndex` "
    "ignores the hint in comparisons).",
}


def _field_diffs(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The dotted names of the dataclass fields in which ``a`` and ``b`` differ."""
    if not dataclasses.is_dataclass(a) or type(a) is not type(b):
        return [] if a == b else [(prefix.rstrip("."), a, b)]
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(a):
        out += _field_diffs(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
    return out


def _storage_data(sd: Any) -> str:
    """A global plan's ``storage_data``: a plain value, or a dataclass with the directory's
    identity (device, inode, a random id) shown as ``<dir id>``."""
    if not dataclasses.is_dataclass(sd) or isinstance(sd, type):
        return repr(sd)
    fields = [
        f"{f.name}=<dir id>" if f.name == "directory" else f"{f.name}={getattr(sd, f.name)!r}"
        for f in dataclasses.fields(sd)
    ]
    return f"{type(sd).__name__}({', '.join(fields)})"


def _where(run: PathRun, info: Any) -> str:
    return f"`{run.mask(info.relative_path)}` @ {info.offset} +{info.length} B"


def render(rec: Record) -> str:
    ref = rec.reference
    out = [
        "# The life of a save, as data",
        "",
        "<!-- generated by `python -m refdcp.tools.life_of_a_save`; do not edit by hand -->",
        "",
        "This page is generated from a real run (`refdcp/tools/life_of_a_save.py`;",
        "`tests/test_life_of_a_save.py` fails when it is stale, TOOL-27): a small model",
        f"saved by `refdcp.reference.save` at {SAVE_WORLD} fake ranks (`FakeWorld`) into a",
        "real temporary directory, with the reference's planners and writer, then loaded at",
        f"{LOAD_WORLD} ranks by `refdcp.reference.load`. Every object is shown as a rank",
        "sent or received it: a deep copy taken at that moment, not the object after later",
        "steps changed it. The storage calls come in the order of the writer and reader",
        "contracts of `spec/protocol.md`. Section 7 runs the same save and load through the",
        "default path and lists what it does differently.",
        "",
        "The code that ran, in reading order: `refdcp/reference/api.py` (save, load), its",
        "drive loop and step bodies `refdcp/reference/run.py` over the protocol tables",
        "`refdcp/protocol/save.py` and `load.py`, the planners",
        "`refdcp/reference/save_planner.py` (with `dedup.py`, `metadata.py`) and",
        "`load_planner.py`, the storage `refdcp/reference/storage.py` (with `format.py`).",
        "docs/glossary.md names each term and its torch name.",
        "",
        "The model, on every rank: `embed`, an 8 x 4 float32 tensor sharded by rows",
        "(`LocalShards`, two rows per rank at 4 ranks); `head.weight` (4 x 4) and",
        "`head.bias` (4), which every rank holds in full; `step`, a Python int.",
        "Random values are masked so the page is the same on every run: the temporary",
        "directory is `<dir>`, the save's random file token `<token>` (STORE-2).",
        "",
        "## 1. Local plans, as each rank sent them",
        "",
        "Each rank's `create_local_plan`, then its writer's `prepare_local_plan`,",
        "gathered to the coordinator (SAVE-2). One write item per chunk the rank holds",
        "(PLAN-1); `planner_data` carries the structure and the replica check's data.",
        "",
    ]
    seen = _local_plans(ref, out)
    unused = sorted(set(FIELDS) - seen)
    if unused:
        raise UnexplainedField(f"FIELDS explains fields no plan carries: {unused}")
    out += [
        "## 2. Global plans after dedup, as each rank received them",
        "",
        "The coordinator's `create_global_plan` keeps one writer per replicated item",
        "(DEDUP-1, DEDUP-2), then its writer's `prepare_global_plan` names each",
        "rank's data file (`storage_data`); plan `i` is scattered to rank `i` (SAVE-3).",
        "",
    ]
    for r in sorted(ref.save_final):
        plan = ref.save_final[r]
        out.append(f"### Rank {r}")
        out.append("")
        out.extend(f"- item: {_write_item(it)}" for it in plan.items)
        out.append(f"- `storage_data`: `{ref.mask(_storage_data(plan.storage_data))}`")
        out.append(f"- `planner_data`: `{plan.planner_data!r}`")
        out.append("")
    out += [
        "## 3. Write results, as each rank sent them",
        "",
        "`write_data`'s results, gathered to the coordinator (SAVE-5): where each item",
        "lies (`relative_path`, `offset`, `length`), its CRC-32C `refdcp_crc32c`",
        "(INTEG-1) and, for a tensor, where its raw data starts inside the item",
        "(`refdcp_data_offset`).",
        "",
    ]
    for r in sorted(ref.writes):
        out.append(f"### Rank {r}")
        out.append("")
        for wr in ref.writes[r]:
            sd = dict(vars(wr.storage_data))
            out.append(
                f"- `{wr.index.fqn}` {list(wr.index.offset or ())}: {wr.size_in_bytes} B, "
                f"storage `{ref.mask(repr(sd))}`"
            )
        out.append("")
    md = ref.committed
    assert md is not None
    out += [
        "## 4. The files on disk",
        "",
        "What the save left in the directory, read back byte by byte. Objects come first",
        "in a rank's file, then each tensor chunk starts on a 64-byte boundary, after",
        "zero padding (FMT-2, STORE-50); each item is a whole `torch.save` archive (a zip",
        "file, FMT-3), so `torch.load` reads it alone.",
        "",
        *_files(ref),
        "",
        "The zip entries of each stored item:",
        "",
        *_framing(ref),
        "",
        "## 5. The metadata, as committed",
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
            f"- `{idx.fqn}` {list(idx.offset or ())} -> {_where(ref, info)}, crc32c "
            f"0x{getattr(info, 'refdcp_crc32c', 0):08x}"
        )
    out += [
        "",
        f"`planner_data`: `{md.planner_data!r}`",
        "",
        f"`storage_meta`: `{ref.mask(repr(md.storage_meta))}`; `version`: `{md.version!r}`",
        "",
        f"## 6. A load at {LOAD_WORLD} ranks: read plans",
        "",
        "Each rank asks for its own rows of `embed` (rank 2 holds the last four);",
        "the load planner intersects them with the saved chunks (RESHARD-1,",
        "RESHARD-2). Plans as each rank received them from the coordinator (LOAD-3),",
        "with the byte range of the file each read takes; the reader checks each",
        "range's CRC-32C before it hands it on (LOAD-10, INTEG-3).",
        "",
    ]
    for r in sorted(ref.load_final):
        out.append(f"### Rank {r}")
        out.append("")
        for ri in ref.load_final[r].items:
            info = md.storage_data[ri.storage_index]
            out.append(f"- read: {_read_item(ri)}; from {_where(ref, info)}")
        out.append("")
    out += _differences(ref, rec.default)
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
