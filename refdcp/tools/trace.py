"""``refdcp trace``: watch a save and a load across fake ranks, step by step (TRACE-1..6).

A small model is saved at one world size and loaded at another by the
deterministic simulator (`refdcp.driver.simulate`: every rank's machine in one
thread, in rank order), with refdcp's planners and in-memory storage, so the
output is identical on every run. The trace shows, per rank and step: the
protocol steps, local plans, the global plan with each dedup decision and its
reason, what each rank wrote where, the committed metadata, and on load the
read boxes that reshard saved chunks onto the new layout.

``reference=True`` (``refdcp trace --reference``) runs ``refdcp.reference.save``
and ``refdcp.reference.load`` instead, with their own planners, writer and
reader, at ``FakeWorld`` ranks on a real directory (a temporary one unless one is
given), so the trace also shows the files the reference writer made, each item's
byte range in them and its framing (TRACE-14).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import sys
import tempfile
import threading
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from refdcp.driver import LoadContext, SaveContext, StepRecord, simulate
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner, LocalShards
from refdcp.planning.local_plan import chunk_nbytes
from refdcp.planning.metadata.build import build_state_dict_metadata
from refdcp.protocol import LOAD, SAVE, Kind
from refdcp.protocol.names import Phase, Slot
from refdcp.reference import (
    ReferenceLoadPlanner,
    ReferenceSavePlanner,
    ReferenceWriter,
)
from refdcp.reference.dedup import Decision, reference_dedup
from refdcp.reference.format import METADATA, TRAILER
from refdcp.reference.metadata import build_metadata
from refdcp.storage.fs.paths import open_regular
from refdcp.storage.memory import MemoryStorage

__all__ = [
    "FORMATS",
    "archive_entries",
    "file_layout",
    "read_checkpoint_files",
    "TraceResult",
    "render_mermaid",
    "render_text",
    "run_trace",
    "step_label",
    "trace_command",
]

SHARDINGS = ("rows", "cols", "replicated")
_EMBED = (8, 4)


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Torch.chunk-style split of ``n`` into ``parts``: (start, length) of part ``i``."""
    step = -(-n // parts)
    start = min(i * step, n)
    return start, min(step, n - start)


def model_state(rank: int, world: int, sharding: str) -> dict[str, Any]:
    """The traced model on one rank: a sharded embedding, a replicated head, a step counter."""
    full = torch.arange(_EMBED[0] * _EMBED[1], dtype=torch.float32).reshape(_EMBED)
    if sharding == "replicated":
        embed: Any = full.clone()
    else:
        dim = 0 if sharding == "rows" else 1
        start, length = _split(_EMBED[dim], world, rank)
        piece = full.narrow(dim, start, length).clone()
        offsets = (start, 0) if dim == 0 else (0, start)
        embed = LocalShards(_EMBED, [(offsets, piece)] if length else [], dtype=torch.float32)
    return {
        "model": {
            "embed.weight": embed,
            "head.weight": torch.eye(4) * 2.0,
            "head.bias": torch.ones(4),
        },
        "step": 100,
    }


def empty_model_state(rank: int, world: int, sharding: str) -> dict[str, Any]:
    src = model_state(rank, world, sharding)
    embed = src["model"]["embed.weight"]
    if isinstance(embed, LocalShards):
        embed = LocalShards(
            _EMBED, [(off, torch.zeros_like(t)) for off, t in embed.chunks], dtype=torch.float32
        )
    else:
        embed = torch.zeros(_EMBED)
    return {
        "model": {
            "embed.weight": embed,
            "head.weight": torch.zeros(4, 4),
            "head.bias": torch.zeros(4),
        },
        "step": 0,
    }


class _NoDedupPlanner(DefaultSavePlanner):
    """Shows why dedup exists: every holder writes every replica, and validation refuses it."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from refdcp.planning.metadata.build import PlanValidationError

        _, problems = build_state_dict_metadata([list(p.items) for p in all_plans])
        raise PlanValidationError(problems or ["no overlap found"])


@dataclass
class TraceResult:
    save_world: int
    load_world: int
    sharding: str
    dedup: bool
    save_steps: list[StepRecord] = field(default_factory=list)
    load_steps: list[StepRecord] = field(default_factory=list)
    local_plans: list[SavePlan] = field(default_factory=list)
    final_plans: list[SavePlan] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    writes: list[list[Any]] = field(default_factory=list)
    metadata: Metadata | None = None
    read_plans: list[LoadPlan] = field(default_factory=list)
    save_error: str | None = None
    verified: bool = False
    #: with ``reference=True``: the directory saved into, whether it was a temporary one
    #: (removed when the trace ended), and every file the save left there, by name
    directory: str | None = None
    temporary: bool = False
    files: dict[str, bytes] = field(default_factory=dict)


def explain_dedup(local: Sequence[SavePlan], final: Sequence[SavePlan]) -> list[Decision]:
    """Each replicated (fqn, chunk): who held it, who writes it, and why (TRACE-3, TRACE-7).

    The records are the reference rule's own (``refdcp/reference/dedup.py``),
    for the planner's default options; a writer that differs from the
    planner's actual choice (``final``) is flagged with ``(!)``.
    """
    _, _, decisions = reference_dedup([list(p.items) for p in local])
    writer = {
        (it.index.fqn, tuple(int(o) for o in (it.index.offset or ()))): r
        for r, p in enumerate(final)
        for it in p.items
    }
    out = []
    for d in decisions:
        actual = writer.get((d.fqn, d.offsets), -1)
        if actual != d.writer:
            d = dataclasses.replace(d, reason=f"{d.reason} (!) the planner chose rank {actual}")
        out.append(d)
    return out


def run_trace(
    save_world: int = 4,
    load_world: int = 2,
    sharding: str = "rows",
    dedup: bool = True,
    reference: bool = False,
    directory: str | os.PathLike[str] | None = None,
) -> TraceResult:
    """Save at ``save_world`` ranks, load at ``load_world``, and record everything (TRACE-1);
    ``reference=True`` runs ``refdcp.reference.save``/``load`` on a real directory, a
    temporary one unless ``directory`` names a new or empty one (TRACE-14)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}")
    for name, world in (("save_world", save_world), ("load_world", load_world)):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"{name} must be an int >= 1, got {world!r}")
    res = TraceResult(save_world, load_world, sharding, dedup)
    if directory is not None and not reference:
        raise ValueError(
            "a directory is only for reference=True: the default trace saves in memory"
        )
    if reference:
        if directory is None:
            with tempfile.TemporaryDirectory(prefix="refdcp-trace-") as tmp:
                res.temporary = True
                return _reference_trace(res, tmp)
        if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
            raise ValueError(f"{directory} is not a new or empty directory")
        return _reference_trace(res, os.fspath(directory))
    store = MemoryStorage()
    planner_cls: type[SavePlanner] = DefaultSavePlanner if dedup else _NoDedupPlanner
    load_planner_cls: type[LoadPlanner] = DefaultLoadPlanner
    saves = [
        SaveContext(
            rank=r,
            world_size=save_world,
            coordinator=r == 0,
            state_dict=model_state(r, save_world, sharding),
            writer=store.writer("trace"),
            planner=planner_cls(),
        )
        for r in range(save_world)
    ]
    sim = simulate(SAVE, saves, observer=res.save_steps.append)
    res.local_plans = [c.slots[Slot.LOCAL_PLAN] for c in saves]
    errors = sim.errors()
    if errors:
        res.save_error = str(errors[0]).splitlines()[0] + "\n" + _problem_lines(errors[0])
        return res
    res.final_plans = [c.slots[Slot.FINAL_PLAN] for c in saves]
    res.decisions = explain_dedup(res.local_plans, res.final_plans)
    res.writes = [list(c.slots[Slot.WRITE_RESULTS].results) for c in saves]
    res.metadata = sim.results[0]
    loads = [
        LoadContext(
            rank=r,
            world_size=load_world,
            coordinator=r == 0,
            state_dict=empty_model_state(r, load_world, sharding),
            reader=store.reader("trace"),
            planner=load_planner_cls(),
        )
        for r in range(load_world)
    ]
    lsim = simulate(LOAD, loads, observer=res.load_steps.append)
    if lsim.errors():
        raise next(iter(lsim.errors().values()))
    res.read_plans = [c.slots[Slot.FINAL_PLAN] for c in loads]
    res.verified = all(
        _same(c.state_dict, model_state(c.rank, load_world, sharding)) for c in loads
    )
    return res


# --- the files on disk (TRACE-14) ----------------------------------------------------------


def read_checkpoint_files(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every regular file of a checkpoint directory, by name in sorted order, read through
    refdcp's one opening rule (STORE-59): ``.metadata`` first, then the data files."""
    out: dict[str, bytes] = {}
    for name in sorted(os.listdir(directory)):
        fd = open_regular(os.path.join(directory, name), os.O_RDONLY)
        with open(fd, "rb") as f:
            out[name] = f.read()
    return out


def archive_entries(blob: bytes) -> list[str]:
    """The entry names of a stored item's ``torch.save`` zip archive, its folder dropped
    (FMT-3); ``["not a zip archive"]`` for anything else."""
    if not blob.startswith(b"PK\x03\x04"):
        return ["not a zip archive"]
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        return [i.filename.partition("/")[2] or i.filename for i in archive.infolist()]


def file_layout(data: bytes, items: Sequence[tuple[int, int, str]]) -> list[str]:
    """Each byte range of a data file, in order: an item (``label``), or the bytes between
    items, named as zero padding when they are all zero (STORE-50)."""
    out: list[str] = []
    pos = 0
    for offset, length, label in sorted(items):
        if offset > pos:
            gap = data[pos:offset]
            what = "zero padding" if gap == bytes(len(gap)) else "unexplained bytes"
            out.append(f"[{pos}, {offset}) {offset - pos} B {what}")
        zipped = data[offset : offset + 4] == b"PK\x03\x04"
        magic = "a torch.save zip archive" if zipped else "not a zip archive"
        out.append(f"[{offset}, {offset + length}) {length} B {label}: {magic}")
        pos = max(pos, offset + length)
    if pos < len(data):
        out.append(f"[{pos}, {len(data)}) {len(data) - pos} B after the last item")
    return out


class _NoDedupReference(ReferenceSavePlanner):
    """The reference planner without dedup: every holder writes every replica, refused."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from refdcp.planning.metadata.build import PlanValidationError

        _, problems = build_metadata([list(p.items) for p in all_plans])
        raise PlanValidationError(problems or ["no overlap found"])


class _Recorder:
    """What the reference's ranks sent and received, as deep copies taken at that moment."""

    def __init__(self, save_world: int, load_world: int) -> None:
        self.lock = threading.Lock()
        self.local: list[Any] = [None] * save_world
        self.final: list[Any] = [None] * save_world
        self.writes: list[list[Any]] = [[] for _ in range(save_world)]
        self.reads: list[Any] = [None] * load_world

    def put(self, slot: list[Any], rank: int, value: Any) -> None:
        with self.lock:
            slot[rank] = copy.deepcopy(value)


def _recording_save_planner(rec: _Recorder, rank: int, base: type[Any]) -> Any:
    class Recording(base):  # type: ignore[misc]
        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            plan: SavePlan = super().finish_plan(new_plan)
            rec.put(rec.final, rank, plan)  # the plan this rank writes
            return plan

    return Recording()


class _RecordingLoadPlanner(ReferenceLoadPlanner):
    def __init__(self, rec: _Recorder, rank: int) -> None:
        super().__init__()
        self.rec, self.rec_rank = rec, rank

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        plan: LoadPlan = super().finish_plan(central_plan)
        self.rec.put(self.rec.reads, self.rec_rank, plan)  # the plan this rank reads
        return plan


class _RecordingWriter(ReferenceWriter):
    """The reference writer, recording the local plan each rank sends and its write results."""

    def __init__(self, path: str, rec: _Recorder, rank: int) -> None:
        super().__init__(path)
        self.rec, self.rec_rank = rec, rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        out = super().prepare_local_plan(plan)
        self.rec.put(self.rec.local, self.rec_rank, out)  # as this rank sends it
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        self.rec.put(self.rec.writes, self.rec_rank, fut.wait())
        return fut


def _in_protocol_order(records: list[Any]) -> list[StepRecord]:
    """Records from ranks that ran on threads, in one deterministic order: by phase in
    protocol order, then by rank (each rank's own records keep their order)."""
    order = {p.value: i for i, p in enumerate(Phase)}
    return sorted(records, key=lambda r: (order.get(str(r.phase), len(order)), r.rank, r.index))


def _reference_trace(res: TraceResult, directory: str) -> TraceResult:
    """The save and the load through ``refdcp.reference`` at FakeWorld ranks (TRACE-14)."""
    import refdcp.reference
    from refdcp.comm.fake import FakeWorld

    res.directory = directory
    rec = _Recorder(res.save_world, res.load_world)
    base = ReferenceSavePlanner if res.dedup else _NoDedupReference
    save_steps: list[Any] = []  # refdcp.reference.run.StepRecord: the same fields

    def save_rank(comm: Any) -> Metadata:
        r = comm.rank
        md: Metadata = refdcp.reference.save(
            model_state(r, res.save_world, res.sharding),
            storage_writer=_RecordingWriter(directory, rec, r),
            planner=_recording_save_planner(rec, r, base),
            comm=comm,
            observer=save_steps.append,
        )
        return md

    saved = FakeWorld(res.save_world).run(save_rank, return_exceptions=True)
    res.save_steps = _in_protocol_order(save_steps)
    res.local_plans = list(rec.local)
    res.files = read_checkpoint_files(directory) if os.path.isdir(directory) else {}
    errors = [e for e in saved if isinstance(e, BaseException)]
    if errors:
        res.save_error = str(errors[0]).splitlines()[0] + "\n" + _problem_lines(errors[0])
        return res
    res.final_plans = list(rec.final)
    res.decisions = explain_dedup(res.local_plans, res.final_plans)
    res.writes = list(rec.writes)
    res.metadata = saved[0]
    load_steps: list[Any] = []

    def load_rank(comm: Any) -> dict[str, Any]:
        state = empty_model_state(comm.rank, res.load_world, res.sharding)
        refdcp.reference.load(
            state,
            checkpoint_id=directory,
            planner=_RecordingLoadPlanner(rec, comm.rank),
            comm=comm,
            observer=load_steps.append,
        )
        return state

    loaded = FakeWorld(res.load_world).run(load_rank)
    res.load_steps = _in_protocol_order(load_steps)
    res.read_plans = list(rec.reads)
    res.verified = all(
        _same(state, model_state(r, res.load_world, res.sharding)) for r, state in enumerate(loaded)
    )
    return res


def _problem_lines(err: BaseException) -> str:
    """The planner's list of problems, once each (the message and traceback both carry it)."""
    failures = getattr(err, "rank_failures", {})
    problems: list[str] = []
    for f in failures.values():
        problems += [p for p in getattr(f.exception, "problems", []) if p not in problems]
    if not problems:
        lines = str(err).splitlines()
        problems = [x.lstrip()[2:] for x in lines if x.lstrip().startswith("- '")]
        problems = list(dict.fromkeys(problems))
    return "\n".join(f"- {p}" for p in problems)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return all(_same(got[k], v) for k, v in want.items())
    if isinstance(want, LocalShards):
        return all(torch.equal(g, w) for (_, g), (_, w) in zip(got.chunks, want.chunks))
    if isinstance(want, torch.Tensor):
        return bool(torch.equal(got, want))
    return bool(got == want)


# --- rendering ------------------------------------------------------------------------------


def _box(offsets: Any, sizes: Any) -> str:
    return f"[{', '.join(f'{int(o)}:{int(o) + int(s)}' for o, s in zip(offsets, sizes))}]"


def _write_item(it: WriteItem) -> str:
    if it.type == WriteItemType.BYTE_IO or it.tensor_data is None:
        return f"{it.index.fqn}  (object, torch.save bytes)"
    td = it.tensor_data
    dtype = str(td.properties.dtype).replace("torch.", "")
    return (
        f"{it.index.fqn}  {dtype} box {_box(td.chunk.offsets, td.chunk.sizes)} "
        f"of {list(td.size)}  {chunk_nbytes(it)} B"
    )


def step_label(rec: StepRecord) -> str:
    """A step's honest name (TRACE-10): a local step by its name, a collective by its kind
    and what it carries, e.g. ``all_gather(read_outcome)``: every rank receives every
    rank's outcome, so every rank learns of every failure."""
    if rec.kind is Kind.LOCAL:
        return rec.step
    return f"{rec.kind.value}({rec.step})" if rec.step else rec.kind.value


def _steps(records: list[StepRecord], world: int) -> list[str]:
    out = []
    for r in range(world):
        seq = [f"{step_label(rec)}:{rec.outcome.value}" for rec in records if rec.rank == r]
        out.append(f"  rank {r}: " + " -> ".join(seq))
    return out


def _read_item(md: Metadata, ri: ReadItem) -> str:
    fqn = ri.dest_index.fqn
    entry = md.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata):
        return f"{fqn}  (object) replaces the destination value"
    src_off = ri.storage_index.offset or ()
    glob_src = [int(a) + int(b) for a, b in zip(src_off, ri.storage_offsets)]
    dst_off = ri.dest_index.offset or ()
    glob_dst = [int(a) + int(b) for a, b in zip(dst_off, ri.dest_offsets)]
    return (
        f"{fqn}  global {_box(glob_src, ri.lengths)}: saved chunk at {list(map(int, src_off))} "
        f"-> local chunk at {list(map(int, dst_off))}" + ("" if glob_src == glob_dst else "  (!)")
    )


_STEPS_HEADER = "protocol steps (step:outcome; a collective shows as kind(what it carries)):"


#: Where the trace's files live, and why their names differ from a filesystem save's (TRACE-13).
_STORAGE_NOTE = (
    "storage: refdcp.MemoryStorage (in memory, deterministic: file names carry the save's "
    "generation, g1, where a filesystem save puts a random hex token, STORE-2, STORE-22)"
)


def _storage_note(res: TraceResult) -> str:
    if res.directory is None:
        return _STORAGE_NOTE
    kept = (
        "a temporary directory, removed when the trace ends; --dir keeps the files"
        if res.temporary
        else "the files stay there"
    )
    return (
        "storage: refdcp.reference.save and refdcp.reference.load with the reference's "
        f"planners, ReferenceWriter and ReferenceReader, on the real directory {res.directory} "
        f"({kept}; file names carry the save's random hex token, STORE-2)"
    )


def _files_section(res: TraceResult) -> list[str]:
    """Every file the reference save left, with each item's byte range and framing (TRACE-14)."""
    if res.directory is None:
        return []
    lines = ["", "files on disk (what the reference writer made, byte range by byte range):"]
    items: dict[str, list[tuple[int, int, str]]] = {}
    if res.metadata is not None:
        for idx, info in res.metadata.storage_data.items():
            kind = res.metadata.state_dict_metadata[idx.fqn]
            what = "object" if isinstance(kind, BytesStorageMetadata) else "tensor chunk"
            off = f" {list(map(int, idx.offset))}" if idx.offset is not None else ""
            label = f"{idx.fqn}{off} ({what})"
            items.setdefault(info.relative_path, []).append((info.offset, info.length, label))
    for name, data in res.files.items():
        lines.append(f"  {name}  {len(data)} B")
        if name == METADATA:
            _, sep, trailer = data.rpartition(TRAILER)
            tail = f"then the trailer {(sep + trailer)!r}" if sep else "no checksum trailer"
            lines.append(
                f"    pickle of the Metadata (protocol {data[1] if len(data) > 1 else '?'}), "
                f"{tail} (FMT-1, INTEG-2); the commit point is its rename onto this name"
            )
        else:
            lines.extend(f"    {x}" for x in file_layout(data, items.get(name, [])))
    infos = res.metadata.storage_data.values() if res.metadata is not None else []
    entries = {
        ", ".join(archive_entries(res.files[i.relative_path][i.offset : i.offset + i.length]))
        for i in infos
        if i.relative_path in res.files
    }
    if entries:
        lines.append("  zip entries of the stored items: " + " | ".join(sorted(entries)))
    return lines


def render_text(res: TraceResult) -> str:
    lines = [
        f"refdcp trace: save at world {res.save_world}, load at world {res.load_world} "
        f"(sharding={res.sharding}, dedup={'on' if res.dedup else 'off'})",
        _storage_note(res),
        "",
        "== SAVE ==",
        _STEPS_HEADER,
        *_steps(res.save_steps, res.save_world),
        "",
        "local plans (every rank plans every chunk it holds):",
    ]
    for r, plan in enumerate(res.local_plans):
        lines.append(f"  rank {r}: {len(plan.items)} item(s)")
        lines.extend(f"    {_write_item(it)}" for it in plan.items)
    if res.save_error is not None:
        lines += [
            "",
            "global plan: REFUSED by the coordinator",
            *(f"  {x}" for x in res.save_error.splitlines()),
        ]
        lines += [
            "",
            "Without dedup several ranks would write the same chunk: validation rejects the overlap.",
            *_files_section(res),
        ]
        return "\n".join(lines) + "\n"
    lines += ["", "global plan (coordinator, rank 0): dedup of replicated chunks, largest first"]
    for d in res.decisions:
        lines.append(
            f"  {d.fqn} {list(d.offsets)} ({d.nbytes} B) held by {d.holders} -> rank {d.writer}: {d.reason}"
        )
    lines += ["", "writes (what each rank wrote where):"]
    for r, results in enumerate(res.writes):
        for wr in results:
            info = wr.storage_data
            where = (
                f"{info.relative_path} @ {info.offset} +{info.length} B"
                if isinstance(info, _StorageInfo)
                else repr(info)
            )
            off = list(map(int, wr.index.offset)) if wr.index.offset is not None else "object"
            lines.append(f"  rank {r}: {wr.index.fqn} {off} -> {where}")
    assert res.metadata is not None
    lines += _files_section(res)
    lines += ["", "committed metadata (the commit point: the coordinator's finish returned):"]
    for fqn, entry in res.metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            lines.append(f"  {fqn}: object")
        else:
            assert isinstance(entry, TensorStorageMetadata)
            chunks = ", ".join(_box(c.offsets, c.sizes) for c in entry.chunks)
            dtype = str(entry.properties.dtype).replace("torch.", "")
            lines.append(f"  {fqn}: {dtype} {list(entry.size)} chunks {chunks}")
    lines += [
        "",
        "== LOAD ==",
        _STEPS_HEADER,
        *_steps(res.load_steps, res.load_world),
        "  (gather: rank 0 receives; scatter, broadcast: rank 0 sends; all_gather: every rank",
        "   receives every rank's outcome, so a failed read or apply on any rank makes every",
        "   rank raise, and no rank applies a partial load)",
    ]
    lines += ["", "read boxes (saved chunks resharded onto each rank's layout):"]
    for r, load_plan in enumerate(res.read_plans):
        lines.append(f"  rank {r}: {len(load_plan.items)} read(s)")
        for ri in load_plan.items:
            lines.append(f"    {_read_item(res.metadata, ri)}")
            if res.directory is not None:
                info = res.metadata.storage_data[ri.storage_index]
                lines.append(
                    f"      reads {info.relative_path} @ {info.offset} +{info.length} B, "
                    "checks its CRC-32C (LOAD-10)"
                )
    lines += ["", f"loaded values equal the saved ones: {'yes' if res.verified else 'NO'}"]
    return "\n".join(lines) + "\n"


def render_mermaid(res: TraceResult, *, markdown: bool = False) -> str:
    """A mermaid sequence diagram of the save and the load (TRACE-5, TRACE-11, TRACE-12).

    Plain mermaid source (a valid ``.mmd`` file) unless ``markdown`` wraps it
    in a fenced block. Every collective is drawn as the messages it really
    exchanges: gathers go to the coordinator, scatters and broadcasts come from
    it, and an all-gather sends every rank's value to every other rank.
    """
    world = max(res.save_world, res.load_world)
    lines = ["sequenceDiagram"]
    lines += [f"    participant R{r} as rank {r}" for r in range(world)]
    lines.append("    participant S as storage")
    for title, records, w in (
        ("save", res.save_steps, res.save_world),
        ("load", res.load_steps, res.load_world),
    ):
        if not records:
            continue
        lines.append(f"    Note over R0,S: {title} at world {w}")
        done: set[tuple[str, int]] = set()
        noted: set[str] = set()
        for rec in records:
            key = (rec.phase, rec.rank)
            if key in done:
                continue
            done.add(key)
            me, label = f"R{rec.rank}", step_label(rec)
            if rec.kind is Kind.LOCAL:
                target = "S" if rec.step in ("write", "read", "commit") else me
                lines.append(f"    {me}->>{target}: {rec.step} ({rec.outcome.value})")
            elif rec.kind is Kind.ALL_GATHER:
                if rec.phase not in noted:
                    noted.add(rec.phase)
                    span = "R0" if w == 1 else f"R0,R{w - 1}"
                    lines.append(
                        f"    Note over {span}: {label}: every rank receives every rank's "
                        f"{rec.step}"
                    )
                lines += [f"    {me}->>R{o}: {label}" for o in range(w) if o != rec.rank]
            elif rec.kind is Kind.GATHER and rec.rank != 0:
                lines.append(f"    {me}->>R0: {label}")
            elif rec.kind in (Kind.SCATTER, Kind.BROADCAST) and rec.rank != 0:
                lines.append(f"    R0->>{me}: {label}")
        if title == "save" and res.save_error is not None:
            lines.append("    Note over R0: global plan refused: overlapping replicas")
    body = "\n".join(lines) + "\n"
    return f"```mermaid\n{body}```\n" if markdown else body


FORMATS = ("text", "mermaid", "markdown")


def trace_command(
    *,
    save_world: int = 4,
    load_world: int = 2,
    fmt: str = "text",
    dedup: bool = True,
    sharding: str = "rows",
    out: TextIO | None = None,
    reference: bool = False,
    directory: str | os.PathLike[str] | None = None,
) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    stream = out or sys.stdout
    res = run_trace(save_world, load_world, sharding, dedup, reference, directory)
    if fmt == "text":
        stream.write(render_text(res))
    else:
        stream.write(render_mermaid(res, markdown=fmt == "markdown"))
    return 0 if (res.save_error is None and res.verified) or not dedup else 1
