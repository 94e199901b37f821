"""refdcp's DefaultSavePlanner: torch's SavePlanner built from pure functions (PLAN-*, DEDUP-*, META-*)."""

from __future__ import annotations

import dataclasses
import gc
import io
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.errors import ProtocolError
from refdcp.storage.format.records import value_crc_of

from .dedup.blocks import valid_blocks
from .dedup.classes import dedup_items
from .dedup.deferred import (
    DigestJob,
    RankDigests,
    ReplicaMismatchError,
    group_of,
    replica_problems,
)
from .flatten import RESERVED_KEY, Flattened, encode_structure, flatten_state_dict
from .loadable import refuse_unloadable
from .local_plan import (
    item_key,
    may_be_replicated,
    plan_and_block_digests,
    replica_checksums,
    resolve_tensor_chunk,
    save_items,
    tensors_without_chunks,
)
from .metadata.build import PlanValidationError, build_state_dict_metadata
from .plan_cache import GlobalPlanCache, LocalPlanCache, PlanCacheError, structure_fingerprint

__all__ = ["DefaultSavePlanner"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class DefaultSavePlanner(SavePlanner):
    """Flatten, plan every chunk on every rank, dedup on the coordinator, validate (PLAN-1).

    Positional parameters are torch's, in torch's order (API-10):
    ``flatten_state_dict`` must be True; ``flatten_sharded_tensors`` is
    accepted (ShardedTensors are planned without rewriting, so both values
    behave the same); ``dedup_replicated_tensors`` is deprecated in torch and
    has no effect in either; ``dedup_save_to_lowest_rank`` is torch's option
    (DEDUP-2); ``enable_plan_caching`` reuses the local and global plans of
    the previous save when the structure is unchanged (PLAN-9).
    refdcp's options are keyword-only: ``check_replicas`` (default True)
    compares replica values by digest (DEDUP-6, DEDUP-13);
    ``bytes_on_coordinator`` keeps non-tensor items on the coordinator
    (DEDUP-7); ``coordinator_rank`` is the coordinator's index in the plan list;
    ``safe_globals`` are extra types the caller allows at load, so values of
    those types pass the save-time loadability check (SAVE-12).

    A driver that sends each rank's :meth:`replica_digests_after_write` with
    its write results and hands them all to :meth:`check_replicas_after_write`
    before the commit (refdcp's does) calls :meth:`defer_replica_digests` after
    ``set_up_planner``: tensor replicas are then digested while the rank writes
    (DEDUP-17). Any other driver (torch's ``dcp.save``) gets the digests in
    the local plans, compared before anything is written (DEDUP-13).
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        *,
        check_replicas: bool = True,
        bytes_on_coordinator: bool = True,
        coordinator_rank: int = 0,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        if not flatten_state_dict:
            raise ValueError("refdcp's DefaultSavePlanner always flattens (FLAT-1)")
        if dedup_replicated_tensors is not None:
            warnings.warn(
                "DefaultSavePlanner's `dedup_replicated_tensors` argument is deprecated "
                "(as in torch) and has no effect: replicated items are always deduplicated",
                FutureWarning,
                stacklevel=2,
            )
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.enable_plan_caching = enable_plan_caching
        self.check_replicas = check_replicas
        self.bytes_on_coordinator = bytes_on_coordinator
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        self.coordinator_rank = coordinator_rank
        self.safe_globals = list(safe_globals)
        self.flat = Flattened()
        self.is_coordinator = False
        self.plan: SavePlan | None = None
        self._token = uuid.uuid4().hex
        self._local_cache = LocalPlanCache()
        self._global_cache: GlobalPlanCache | None = None
        self._coordinator_shared: list[WriteItem] = []
        self._deferred = False  # this save digests tensor replicas while writing (DEDUP-17)
        self._deferred_items: list[WriteItem] | None = None
        self._deferred_job: DigestJob | None = None
        self._deferred_written: list[WriteItem] = []  # digested by the writer on the way
        self._deferred_keys: list[Any] = []  # every digested key, in the items' order
        self._deferred_structure: bytes | None = None  # names those keys (RankDigests.group)
        self._plan_digest: str | None = None  # the digest of this save's local items (PLAN-15)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        with _gc_paused():
            self.flat = flatten_state_dict(state_dict)
        self.storage_meta = storage_meta
        self.is_coordinator = is_coordinator
        self._deferred, self._deferred_items, self._deferred_job = False, None, None
        self._deferred_written, self._deferred_keys, self._deferred_structure = [], [], None
        self._plan_digest = None

    def defer_replica_digests(self) -> None:
        """Digest this save's tensor replicas while writing, not in the plans (DEDUP-17).

        Only for a driver that then sends :meth:`replica_digests_after_write` to
        the coordinator's :meth:`check_replicas_after_write` before the commit.
        """
        self._deferred = self.check_replicas

    def _replica_sums(self, items: list[WriteItem]) -> dict[Any, int]:
        """The digests the plan carries; tensors' are left for the write when deferred."""
        if self._deferred:
            self._deferred_items = items
            return replica_checksums(self.flat.items, items, tensors=False)
        return replica_checksums(self.flat.items, items)

    def check_values(self) -> None:
        """Refuse values that cannot be saved or never loaded with the defaults (SAVE-12).

        A subclass whose state dict only stands in for values it streams itself
        (``refdcp convert`` plans with meta placeholders) narrows this check.
        """
        refuse_unloadable(self.flat.items, self.safe_globals, self.flat.paths)

    def create_local_plan(self) -> SavePlan:
        self.check_values()  # every save: values change even when the structure does not
        with _gc_paused():
            return self._create_local_plan()

    def _create_local_plan(self) -> SavePlan:
        fingerprint = structure_fingerprint(self.flat) if self.enable_plan_caching else None
        deferred = self.check_replicas and self.is_coordinator
        sums: dict[Any, int] | None = None
        if fingerprint is not None and self._local_cache.hit(fingerprint):
            # unchanged structure: a marker instead of the plan; digests still travel (PLAN-9)
            items = self._local_cache.local_items
            self._plan_digest = self._local_cache.plan_digest  # the digest of these items
            if self.check_replicas and deferred and self._global_cache is not None:
                # the coordinator knows from its cache which of its items others hold
                sums = self._replica_sums(self._global_cache.coordinator_shared)
                deferred = False
            elif self.check_replicas and not deferred:
                sums = self._replica_sums(items)
            marker = {
                "cached": self._local_cache.fingerprint_id,
                "checksums": sums,
                "deferred_token": self._token if deferred else None,
            }
            self._local_cache.pending = None
            self.plan = SavePlan([], planner_data={RESERVED_KEY: marker}, usable=False)
            return self.plan
        items = save_items(self.flat.items)
        if self.check_replicas and not deferred:
            sums = self._replica_sums(items)
        data: dict[str, Any] = dict(self.flat.paths)
        # the coordinator's digests only matter beside other ranks' plans: they are computed
        # in create_global_plan when there are any (DEDUP-8); the blocks let plans that differ
        # share the work of their common items (PLAN-15)
        digest, blocks = (
            (None, None) if self.is_coordinator else plan_and_block_digests(items, sums)
        )
        self._plan_digest = digest
        data[RESERVED_KEY] = {
            **encode_structure(self.flat),
            "digest": digest,
            "blocks": blocks,
            "deferred_digest": self._token if self.is_coordinator else None,
            "checksums": sums,
            "without_chunks": tensors_without_chunks(self.flat.items, items),
            # the coordinator digests only its items other ranks hold, in create_global_plan
            "deferred_token": self._token if deferred else None,
        }
        if fingerprint is not None:
            fid = uuid.uuid4().int >> 64  # names this structure in the coordinator's cache
            data[RESERVED_KEY]["fingerprint"] = fid
            self._local_cache.pending = (fingerprint, fid, items, digest)
        self.plan = SavePlan(items, planner_data=data)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with _gc_paused():
            if not self.enable_plan_caching:
                return self._create_global_plan(all_plans)
            return self._create_global_plan_cached(all_plans)

    def _create_global_plan_cached(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], Metadata]:
        """Reuse the cached global plan when every rank's structure is unchanged (PLAN-10),
        else rebuild it from the changed plans and the cached ones (PLAN-11)."""
        refdcp_data = [_refdcp_data(p) for p in all_plans]
        cache = self._global_cache
        markers = [e.get("cached") is not None for e in refdcp_data]
        if any(markers):
            if cache is None or len(cache.all_plans) != len(all_plans):
                raise PlanCacheError(
                    f"ranks {[r for r, m in enumerate(markers) if m]} reuse a cached plan but the "
                    "coordinator holds none for this world; keep one DefaultSavePlanner instance "
                    "per rank across saves (PLAN-11)"
                )
            stale = [
                r
                for r, e in enumerate(refdcp_data)
                if markers[r] and e["cached"] != cache.fingerprint_ids[r]
            ]
            if stale:
                raise PlanCacheError(
                    f"ranks {stale} reuse cached plans the coordinator does not hold (PLAN-11)"
                )
        if cache is not None and all(markers):
            sums = self._marker_checksums(refdcp_data, cache)
            if not self.check_replicas or cache.replicas_agree(sums):
                unchanged = [SavePlan([], usable=False) for _ in all_plans]
                return unchanged, dataclasses.replace(cache.metadata)
        if any(markers):
            assert cache is not None
            all_plans = [
                _with_new_checksums(cache.all_plans[r], e) if markers[r] else p
                for r, (p, e) in enumerate(zip(all_plans, refdcp_data))
            ]
        self._coordinator_shared = []
        plans, metadata = self._create_global_plan(all_plans)
        self._global_cache = GlobalPlanCache.build(
            all_plans, [_refdcp_data(p) for p in all_plans], plans, metadata
        )
        self._global_cache.coordinator_shared = self._coordinator_shared
        return plans, dataclasses.replace(metadata)

    def _marker_checksums(
        self, refdcp_data: list[dict[str, Any]], cache: GlobalPlanCache
    ) -> list[Any]:
        """Each rank's replica digests; the coordinator's own for the keys others hold (DEDUP-13)."""
        sums: list[Any] = [e.get("checksums") for e in refdcp_data]
        for r, e in enumerate(refdcp_data):
            if self.check_replicas and e.get("deferred_token") == self._token:
                sums[r] = self._replica_sums(cache.coordinator_shared)
        return sums

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        refdcp_data = [_refdcp_data(p) for p in all_plans]
        self._fill_deferred_digest(all_plans, refdcp_data)
        digests = [e.get("digest") for e in refdcp_data]
        if len(all_plans) == 1 and digests[0] is None:
            digests = ["the only rank"]  # one plan: nothing to group it with
        self._fill_deferred_checksums(all_plans, refdcp_data)
        result = dedup_items(
            [p.items for p in all_plans],
            digests=digests,
            checksums=[e.get("checksums") for e in refdcp_data],
            blocks=[e.get("blocks") for e in refdcp_data],
            coordinator_rank=self.coordinator_rank,
            bytes_on_coordinator=self.bytes_on_coordinator,
            lowest_rank=self.dedup_save_to_lowest_rank,
        )
        without_chunks: dict[str, Any] = {}
        for e in reversed(refdcp_data):
            without_chunks.update(e.get("without_chunks") or {})
        md, problems = build_state_dict_metadata(result.plans, without_chunks)
        problems = result.problems + problems + _disagreements_without_chunks(refdcp_data, md)
        if RESERVED_KEY in md:
            problems.append(f"the FQN {RESERVED_KEY!r} is reserved by refdcp's planner")
        if problems:
            raise PlanValidationError(problems)
        planner_data: dict[str, Any] = {}
        rich: dict[str, Any] = {}
        empties: list[Any] = []
        seen_empty: set[Any] = set()
        # ranks with identical plans hold identical FQNs: merge one plan per group,
        # lowest rank winning like torch's ChainMap (FLAT-6)
        for rep in reversed(result.class_reps):
            p, e = all_plans[rep], refdcp_data[rep]
            if isinstance(p.planner_data, dict):
                planner_data.update(p.planner_data)
            rich.update(e.get("rich") or {})
            for path in e.get("empties") or ():
                if path not in seen_empty:
                    seen_empty.add(path)
                    empties.append(path)
        planner_data[RESERVED_KEY] = {"version": 1, "rich": rich, "empties": empties}
        metadata = Metadata(state_dict_metadata=md, planner_data=planner_data)
        plans = [
            dataclasses.replace(p, items=items, planner_data=None)
            for p, items in zip(all_plans, result.plans)
        ]
        return plans, metadata

    def _fill_deferred_digest(
        self, all_plans: list[SavePlan], refdcp_data: list[dict[str, Any]]
    ) -> None:
        """The coordinator's plan digest (without value checksums, as its local plan defers
        them), computed only when other ranks' plans may equal it (DEDUP-8)."""
        if len(all_plans) == 1:
            return
        for plan, e in zip(all_plans, refdcp_data):
            if e.get("deferred_digest") == self._token and e.get("digest") is None:
                # in place: the plan cache reads the digest
                e["digest"], e["blocks"] = plan_and_block_digests(plan.items, None)

    def _fill_deferred_checksums(
        self, all_plans: list[SavePlan], refdcp_data: list[dict[str, Any]]
    ) -> None:
        """The coordinator's own replica digests, for the keys other ranks hold (DEDUP-13).

        A single-rank save digests nothing; other ranks' keys are collected once per
        group of identical plans.
        """
        mine = [r for r, e in enumerate(refdcp_data) if e.get("deferred_token") == self._token]
        if not mine:
            return
        (me,) = mine
        if len(all_plans) == 1:  # nobody else holds anything: nothing to digest
            self._coordinator_shared = []
            self._deferred_items = []
            refdcp_data[me] = {**refdcp_data[me], "checksums": {}}
            return
        my_keys = set(map(item_key, all_plans[me].items))
        my_offsets = {off for _, off in my_keys}
        others: set[Any] = set()  # my keys other ranks hold
        seen: set[Any] = set()
        for r, (p, e) in enumerate(zip(all_plans, refdcp_data)):
            d = e.get("digest")
            if r == me or (d is not None and d in seen):
                continue
            seen.add(d)
            blocks: Any = e.get("blocks")
            if not valid_blocks(blocks, len(p.items)):
                blocks = ([len(p.items)], [None])
            start = 0
            for end, b in zip(*blocks):  # a block seen in another plan holds the same keys
                part, start = p.items[start:end], end
                if b is not None and b in seen:
                    continue
                seen.add(b)
                if not my_offsets.isdisjoint(map(_offset, part)):  # C-level first screen
                    keys = zip(map(_fqn, part), map(_offset, part))
                    others.update(filter(my_keys.__contains__, keys))
        shared = [i for i in all_plans[me].items if item_key(i) in others] if others else []
        self._coordinator_shared = shared
        refdcp_data[me] = {**refdcp_data[me], "checksums": self._replica_sums(shared)}

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """With plan caching: an unchanged plan is the cached final plan; a new one is cached
        together with the local plan it answers (PLAN-9, PLAN-12)."""
        if self.enable_plan_caching:
            cache = self._local_cache
            if not new_plan.usable:
                if cache.final_plan is None:
                    raise PlanCacheError("the coordinator reused a plan this rank never cached")
                new_plan = cache.final_plan
            else:
                if cache.pending is not None:
                    (
                        cache.fingerprint,
                        cache.fingerprint_id,
                        cache.local_items,
                        cache.plan_digest,
                    ) = cache.pending
                    cache.pending = None
                    cache.final_plan = new_plan
                else:  # a rebuilt global plan answering this rank's marker
                    cache.final_plan = new_plan
        self.plan = new_plan
        if self._deferred:
            self._start_deferred_digests(new_plan)
        return new_plan

    def _start_deferred_digests(self, final: SavePlan) -> None:
        """The worker digests the replicas this rank holds but does not write; the writer
        digests the others on the way (DEDUP-17)."""
        flat = self.flat.items
        items = self._deferred_items
        if items is None:  # not planned here (an overridden step): digest every item
            items = save_items(flat)
        late: list[WriteItem] = []
        skipped: list[int] = []  # positions of tensor items no other rank can hold
        for pos, i in enumerate(items):
            if i.type != WriteItemType.BYTE_IO:
                if may_be_replicated(flat[i.index.fqn]):
                    late.append(i)
                else:
                    skipped.append(pos)
        self._deferred_keys = list(map(_key, late))
        # equal local plans (digest) and equal skipped positions: equal keys in equal order
        if not self.is_coordinator and self._plan_digest is not None:
            self._deferred_structure = f"{self._plan_digest}{skipped}".encode()
        # a subclass resolving other data than its state dict's values writes something
        # else than what the other ranks digest: then every item is digested here
        writes = set(map(_key, final.items)) if self._writes_its_values() else set()
        self._deferred_written = [i for i in late if _key(i) in writes]
        others = [i for i in late if _key(i) not in writes] if self._deferred_written else late
        self._deferred_job = DigestJob(flat, others)

    def _writes_its_values(self) -> bool:
        cls = type(self)
        return (
            cls.resolve_data is DefaultSavePlanner.resolve_data
            and cls.lookup_object is DefaultSavePlanner.lookup_object
        )

    def replica_digests_after_write(
        self, results: Sequence[WriteResult] | None
    ) -> RankDigests | None:
        """This rank's tensor value digests, keyed like dedup keys items; None unless
        deferred (DEDUP-17). Those of the items it wrote come from ``results`` where the
        writer recorded them (refdcp's do), else are computed now. ``results=None`` (the
        write failed) only waits for the worker to stop reading the values."""
        if not self._deferred:
            return None
        if self._deferred_job is None:
            raise ProtocolError("DEDUP-17", "replica digests asked before finish_plan started them")
        job, self._deferred_job = self._deferred_job, None
        if results is None:
            job.stop()
            return None
        sums = job.result()
        if self._deferred_written:
            recorded = {(r.index.fqn, r.index.offset): value_crc_of(r) for r in results}
            missing = []
            for item in self._deferred_written:
                value = recorded.get(_key(item))
                if value is None:
                    missing.append(item)
                else:
                    sums[_key(item)] = value
            if missing:
                sums.update(replica_checksums(self.flat.items, missing, objects=False, framed=True))
        ordered = dict(zip(self._deferred_keys, map(sums.__getitem__, self._deferred_keys)))
        structure = self._deferred_structure
        return RankDigests(ordered, group_of(structure, ordered) if structure else None)

    def check_replicas_after_write(self, digests: Sequence[RankDigests | None]) -> None:
        """Coordinator: fail with every key whose ranks sent different digests (DEDUP-17)."""
        problems = replica_problems(digests)
        if problems:
            raise ReplicaMismatchError(problems)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.flat.items[index.fqn]

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The tensor chunk (as stored, any layout) or torch.save bytes (PLAN-6)."""
        obj = self.lookup_object(write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            return buf
        if type(obj) in _PLAIN_TENSORS and not obj.requires_grad:
            plain: torch.Tensor = obj
            return plain  # nothing to detach from: the chunk is the tensor itself
        return resolve_tensor_chunk(obj, write_item.index).detach()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while planning creates many small objects, on any thread (API-20)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_fqn = attrgetter("index.fqn")
_offset = attrgetter("index.offset")
_key = attrgetter("index.fqn", "index.offset")  # item_key, in C


def _refdcp_data(plan: SavePlan) -> dict[str, Any]:
    """refdcp's own entries in a local plan's planner_data (under RESERVED_KEY), or {}."""
    data = plan.planner_data
    if isinstance(data, dict):
        extra = data.get(RESERVED_KEY)
        if isinstance(extra, dict):
            return extra
    return {}


def _with_new_checksums(cached: SavePlan, marker: dict[str, Any]) -> SavePlan:
    """A cached local plan carrying this save's replica digests (digest recomputed by dedup)."""
    data = dict(cached.planner_data) if isinstance(cached.planner_data, dict) else {}
    extra = dict(data.get(RESERVED_KEY) or {})
    extra.update(
        checksums=marker.get("checksums"),
        deferred_token=marker.get("deferred_token"),
        digest=None,  # dedup digests it with this save's checksums
        blocks=None,  # so are its blocks: one block, named by that digest (DEDUP-14)
        deferred_digest=None,
    )
    data[RESERVED_KEY] = extra
    return dataclasses.replace(cached, planner_data=data)


def _disagreements_without_chunks(
    refdcp_data: list[dict[str, Any]], md: dict[str, Any]
) -> list[str]:
    """Ranks holding no chunk of a tensor still state its dtype and shape: check them (META-4)."""
    problems: list[str] = []
    claims: dict[str, dict[Any, list[str]]] = {}
    for rank, e in enumerate(refdcp_data):
        for fqn, (props, size) in (e.get("without_chunks") or {}).items():
            by = claims.setdefault(fqn, {})
            by.setdefault((props.dtype, tuple(size)), []).append(f"rank {rank}")
    for fqn, by in claims.items():
        entry = md.get(fqn)
        if isinstance(entry, TensorStorageMetadata) and entry.chunks:
            key = (entry.properties.dtype, tuple(entry.size))
            by = {**by, key: [*by.get(key, []), "the ranks holding chunks"]}
        if len(by) > 1:
            desc = "; ".join(
                f"{', '.join(who)} say dtype {dt} and global shape {list(sz)}"
                for (dt, sz), who in by.items()
            )
            problems.append(f"{fqn!r}: ranks disagree on dtype or global shape: {desc}")
    return problems
