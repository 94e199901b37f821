"""refdcp's DefaultLoadPlanner: torch's LoadPlanner built from pure functions (RESHARD-*, POLICY-*)."""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from refdcp.errors import RefdcpError
from refdcp.storage.format.items import copy_into_destination
from refdcp.storage.fs.small_reads import register_default_methods
from refdcp.storage.metadata.safe_globals import (
    UnsafeObjectError,
    load_weights_only,
    refused_global,
    unpickler_detail,
)
from refdcp.storage.metadata.stored_layout import check_tiling

from .flatten import Flattened, flatten_state_dict, set_by_rich_path
from .load_policy import LoadPolicy, LoadPolicyError, check_load
from .local_plan import resolve_tensor_chunk
from .read_once import (
    ReadOnceOffer,
    ReadOnceRole,
    ReadOnceState,
    Sent,
    assign_readers,
    box_key,
    check_sender,
    is_bytes,
    piece,
    split_plans,
    unpiece,
)
from .resharding import read_items_for_chunks, whole_tensor_read

__all__ = ["DefaultLoadPlanner", "check_read_once"]


def check_read_once(value: object) -> None:
    """Refuse a ``read_once`` that is not ``True``, ``False`` or ``"auto"`` (ONCE-6)."""
    if value not in (True, False, "auto"):
        raise ValueError(f"read_once must be True, False or 'auto', not {value!r}")


#: Destinations that are one whole local tensor (no chunk list, no shards).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _target_chunks(obj: Any) -> list[ChunkStorageMetadata]:
    create = getattr(obj, "__create_chunk_list__", None)
    if create is not None:
        chunks: list[ChunkStorageMetadata] = create()
        return chunks
    if isinstance(obj, ShardedTensor):
        return [
            ChunkStorageMetadata(
                offsets=torch.Size(s.metadata.shard_offsets),
                sizes=torch.Size(s.metadata.shard_sizes),
            )
            for s in obj.local_shards()
        ]
    return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]


class DefaultLoadPlanner(LoadPlanner):
    """Check the whole state dict against the checkpoint, then plan resharded reads (POLICY-1).

    Positional parameters are torch's, in torch's order (API-10):
    ``flatten_state_dict`` must be True (refdcp always flattens);
    ``flatten_sharded_tensors`` is accepted (refdcp loads ShardedTensors
    without rewriting them, so both values behave the same);
    ``allow_partial_load=True`` is torch's spelling of ``strict=False``.
    refdcp's own options are keyword-only: ``strict`` (default True) rejects
    keys missing from the checkpoint; ``reject_unexpected`` also rejects
    checkpoint keys the state dict lacks; ``allow_cast`` permits dtype
    conversion; ``safe_globals`` extends the allow-list of globals non-tensor
    values may reference (LOAD-8); ``allow_pickle`` loads non-tensor objects
    with ``weights_only=False``; ``read_once`` has each stored item that several
    ranks read read by one of them and sent to the others, when refdcp's
    ``load`` drives the planner (ONCE-1..7): ``True``, ``False``, or ``"auto"``
    (default), which offers it where the load's storage is shared (ONCE-9).
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        strict: bool | None = None,
        reject_unexpected: bool = False,
        allow_cast: bool = False,
        allow_pickle: bool = False,
        safe_globals: Sequence[Any] = (),
        read_once: bool | Literal["auto"] = "auto",
    ) -> None:
        check_read_once(read_once)
        if not flatten_state_dict:
            raise ValueError("refdcp's DefaultLoadPlanner always flattens (FLAT-1)")
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.safe_globals: list[Any] = list(safe_globals)
        self.policy = LoadPolicy(
            strict=(not allow_partial_load) if strict is None else strict,
            reject_unexpected=reject_unexpected,
            allow_cast=allow_cast,
            allow_pickle=allow_pickle,
        )
        self.flat = Flattened()
        self.original_state_dict: dict[Any, Any] = {}
        #: set by refdcp's load driver, which calls apply_loaded_values once every rank read
        #: all its items (LOAD-19); torch's dcp.load has no such step, so values go in at once
        self.defer_nested_values = False
        self.deferred: list[tuple[Any, Any]] = []
        self.metadata: Metadata | None = None
        self.is_coordinator = False
        self.read_once = read_once
        #: set by refdcp's load driver, which carries the pieces in its read outcomes and
        #: calls read_once_outgoing / read_once_receive (ONCE-6); torch's dcp.load does not
        self.exchange_read_once = False
        #: set by refdcp's load driver for ``read_once="auto"``: what makes this load's storage
        #: shared (a URL scheme, a protocol, a file-system type), None where it is not (ONCE-9)
        self.shared_storage: str | None = None
        self._once: ReadOnceState | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None:
            raise ValueError("DefaultLoadPlanner needs the checkpoint's metadata")
        self.original_state_dict = state_dict
        self.deferred = []
        self._once = None  # nothing of an earlier read-once load is kept (ONCE-2)
        self.flat = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """Every problem at once, before any read (POLICY-1); then reads per target chunk (RESHARD-1)."""
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        keys, problems = check_load(self.flat.items, saved, self.policy)
        if problems:
            raise LoadPolicyError(problems)
        check_tiling(self.metadata, keys)  # FMT-28: before any read is planned
        items: list[ReadItem] = []
        for fqn in keys:
            obj = self.flat.items[fqn]
            md = saved[fqn]
            if type(obj) in _PLAIN_TENSORS:
                whole = whole_tensor_read(fqn, md)  # the common case, without the sweep
                if whole is not None:
                    items.append(whole)
                    continue
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            if isinstance(md, TensorStorageMetadata):
                targets = _target_chunks(obj)
                reads = read_items_for_chunks(fqn, md, targets)
                problems += _coverage_problems(fqn, targets, reads)
                items.extend(reads)
            else:
                items.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=_bytes_index(fqn),
                        dest_offsets=torch.Size((0,)),
                        storage_index=_bytes_index(fqn),
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
        if problems:
            raise LoadPolicyError(problems)
        return LoadPlan(items, planner_data=ReadOnceOffer() if self.offers_read_once() else None)

    def offers_read_once(self) -> bool:
        """Whether this rank's local plan offers a read-once load (ONCE-6, ONCE-9)."""
        if not self.exchange_read_once:
            return False
        if self.read_once == "auto":
            return self.shared_storage is not None
        return bool(self.read_once)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """With ``read_once`` offered by every rank: one reader per stored item several
        ranks read (ONCE-1, ONCE-2); otherwise the local plans as they are."""
        if len(global_plan) > 1 and all(
            isinstance(p.planner_data, ReadOnceOffer) for p in global_plan
        ):
            assert self.metadata is not None
            return split_plans(global_plan, assign_readers(global_plan, self.metadata))
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        self._once = None
        role = central_plan.planner_data
        if not isinstance(role, ReadOnceRole):
            return central_plan
        once = self._once = ReadOnceState(role)
        own = [item for item in central_plan.items if item not in once.fetch]
        once.own = {box_key(item): item for item in own}
        extra = []
        if self.policy.allow_cast:  # a cast destination cannot give the stored values back
            for key, item in once.own.items():
                if (
                    key in once.sending
                    and not is_bytes(item)
                    and self.resolve_tensor(item).dtype != self._stored_dtype(item)
                ):
                    extra.append(once.add_fetch(item))
        if extra:
            central_plan = LoadPlan(
                [*central_plan.items, *extra],
                storage_data=central_plan.storage_data,
                planner_data=role,
            )
        return central_plan

    def read_once_outgoing(self, verify: bool | None) -> Sent | None:
        """This rank's read outcome in a read-once load: the boxes it read for the others,
        called once its reads (and their checks) have returned (ONCE-3, ONCE-4)."""
        once = self._once
        if once is None:
            return None
        pieces: dict[Any, Any] = {}
        for key in once.role.sends:
            if key in once.blobs:
                pieces[key] = once.blobs[key]
            elif key in once.scratch:
                pieces[key] = piece(once.scratch[key])
            else:
                pieces[key] = piece(self.resolve_tensor(once.own[key]))
        once.scratch.clear()
        once.blobs.clear()
        return Sent(verify, pieces)

    def read_once_receive(self, outcomes: list[Any], verify: bool | None) -> None:
        """Copy the boxes other ranks read for this one into its destinations (ONCE-3);
        refdcp's driver calls it at the start of the apply step, once every rank has read
        (LOAD-5)."""
        once, self._once = self._once, None
        if once is None:
            return
        senders: dict[int, Sent] = {}
        for item, src in once.role.receives:
            sent = senders.get(src)
            if sent is None:
                sent = senders[src] = check_sender(outcomes[src], src, verify)
            key = box_key(item)
            if key not in sent.pieces:
                raise RefdcpError(
                    f"read-once load: rank {src} sent no box {list(key[2])}+{list(key[3])} "
                    f"of {key[0]!r} chunk {list(key[1])}"
                )
            if is_bytes(item):
                self.load_bytes(item, io.BytesIO(sent.pieces[key]))
            else:
                copy_into_destination(self, item, unpiece(sent.pieces[key]))

    def _stored_dtype(self, item: ReadItem) -> torch.dtype:
        assert self.metadata is not None
        md = self.metadata.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        return md.properties.dtype

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle (weights-only unless ``allow_pickle``) into the original nesting (PLAN-7, FLAT-2)."""
        if self._once is not None:
            self._once.keep_blob(read_item, value)  # sent to the ranks that need it (ONCE-3)
        fqn = read_item.dest_index.fqn
        obj = load_object(fqn, value, self.policy.allow_pickle, self.safe_globals)
        path = self.flat.rich[fqn]
        if len(path) > 1 and self.defer_nested_values:  # placed when the load applies (LOAD-19)
            self.deferred.append((path, obj))
        else:  # top level: the driver's copy, handed over when the load applies (LOAD-5)
            set_by_rich_path(self.original_state_dict, path, obj)
        self.flat.items[fqn] = obj

    def apply_loaded_values(self) -> None:
        """Place the nested non-tensor values read by this load (LOAD-19); the driver calls
        it only once every rank read all its items."""
        deferred, self.deferred = self.deferred, []
        for path, obj in deferred:
            set_by_rich_path(self.original_state_dict, path, obj)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """A view of the destination chunk narrowed to the read's box (RESHARD-1); a
        scratch tensor for a box read only for other ranks (ONCE-2)."""
        once = self._once
        if once is not None and once.fetch and read_item in once.fetch:
            return once.scratch_for(read_item, self._stored_dtype(read_item))
        obj = self.flat.items[read_item.dest_index.fqn]
        if (
            type(obj) in _PLAIN_TENSORS
            and read_item.lengths == obj.shape
            and not any(read_item.dest_offsets)
        ):
            whole: torch.Tensor = obj
            return whole  # a whole plain tensor: nothing to narrow
        if isinstance(obj, DTensor):
            t = obj.to_local()
        else:
            t = resolve_tensor_chunk(obj, read_item.dest_index)
        for d, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            if off != 0 or length != t.shape[d]:
                t = t.narrow(d, off, length)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def load_object(fqn: str, value: io.BytesIO, allow_pickle: bool, extra: Sequence[Any]) -> Any:
    """Unpickle one saved object: weights-only with the default allow-list plus ``extra``
    (LOAD-7, LOAD-8), or unrestricted with ``allow_pickle`` (PLAN-7); a refused global
    raises :class:`UnsafeObjectError` naming the key, the class and the option (LOAD-9)."""
    if allow_pickle:
        return torch.load(value, weights_only=False)
    try:
        return load_weights_only(value, list(extra))
    except pickle.UnpicklingError as e:
        raise UnsafeObjectError(fqn, refused_global(str(e)), unpickler_detail(str(e))) from e


def _bytes_index(fqn: str) -> MetadataIndex:
    return MetadataIndex(fqn)


def _coverage_problems(
    fqn: str, targets: list[ChunkStorageMetadata], reads: list[ReadItem]
) -> list[str]:
    """Saved chunks with holes or overlaps leave a target short or over-read (RESHARD-5)."""
    covered = [0] * len(targets)
    for r in reads:
        covered[r.dest_index.index or 0] += math.prod(r.lengths)
    out = []
    for t, got in zip(targets, covered):
        want = math.prod(t.sizes)
        if got != want:
            how = "leave elements unread" if got < want else "overlap"
            out.append(
                f"{fqn!r}: the checkpoint's chunks {how} in the target chunk at "
                f"{list(t.offsets)} sizes {list(t.sizes)} ({got} of {want} elements read)"
            )
    return out


register_default_methods(DefaultLoadPlanner)  # its resolve/commit are the defaults (STORE-47)
