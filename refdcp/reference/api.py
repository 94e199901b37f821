"""``save`` and ``load`` on the reference path (REF-1): ``refdcp``'s public API, the plain pieces.

Each call chooses its communicator (API-4) and its storage (API-5), then runs
the protocol table (``refdcp.protocol``: SAVE or LOAD) with the reference's
own drive loop and step bodies (:mod:`.run`), the reference planners and the
reference filesystem storage by default. Any torch planner or storage may be
passed instead (API-3). The parameters are ``refdcp.save``'s and
``refdcp.load``'s, in torch's call forms (API-1, API-22); the options the
reference accepts and ignores are listed in spec/reference.md.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.comm import Communicator, SingleRank, TorchDistComm
from refdcp.errors import CheckpointError
from refdcp.protocol import LOAD, SAVE

from .load_planner import ReferenceLoadPlanner
from .run import FaultHook, LoadSteps, Observer, SaveSteps, drive
from .save_planner import ReferenceSavePlanner
from .storage import ReferenceReader, ReferenceWriter

__all__ = ["load", "save"]


class TorchCallForms:
    """``save``/``load`` in torch 2.13's call forms (API-22): ``fn(state_dict, ...keywords)``,
    or ``fn(state_dict, storage)``, the second argument taken as ``keyword=`` with torch's
    warning. The signature is ``fn``'s (``__wrapped__``, API-10)."""

    def __init__(self, fn: Callable[..., Any], keyword: str) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.keyword = fn, keyword

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 2:
            return self.fn(*args, **kwargs)  # one positional argument, or a TypeError
        name, keyword = self.fn.__name__, self.keyword
        if keyword in kwargs:
            raise TypeError(f"{name}() got multiple values for argument {keyword!r}")
        warnings.warn(
            f"{name}(state_dict, {keyword}): the argument order of {name} has changed; "
            f"the second positional argument is taken as {keyword}=, pass it by keyword",
            UserWarning,
            stacklevel=2,
        )
        return self.fn(args[0], **{keyword: args[1]}, **kwargs)


def communicator(
    comm: Communicator | None, process_group: Any = None, no_dist: bool = False
) -> Communicator:
    """The given ``comm``; else one rank for ``no_dist=True`` or an uninitialised
    torch.distributed (with a warning, as torch); else the process group (API-4)."""
    if comm is not None:
        return comm
    if no_dist:
        return SingleRank()
    if not (dist.is_available() and dist.is_initialized()):
        warnings.warn(
            "torch.distributed is not initialized: running as a single rank (no_dist=True)",
            UserWarning,
            stacklevel=4,
        )
        return SingleRank()
    return TorchDistComm(process_group)


def _path(checkpoint_id: Any, storage: object, what: str) -> None:
    """With no storage object, ``checkpoint_id`` is required and names a directory (API-5)."""
    if storage is None and checkpoint_id is None:
        raise ValueError(f"`checkpoint_id` must be given when no {what} is given (API-5)")
    if storage is None and not ReferenceWriter.validate_checkpoint_id(checkpoint_id):
        raise ValueError(
            f"refdcp.reference stores checkpoints in a directory, not at {checkpoint_id!r}; "
            f"pass a {what} for other storage"
        )


@functools.partial(TorchCallForms, keyword="storage_writer")
def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Any = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    comm: Communicator | None = None,
    fault: FaultHook | None = None,
    observer: Observer | None = None,
) -> Metadata:
    """Save ``state_dict`` collectively; every rank returns the committed Metadata (API-1).

    ``fault(i, action)`` runs before this rank's ``i``-th action and may raise
    (PROTO-7); ``observer`` receives a record of every action. A failed save
    removes the files this rank wrote with the reference writer (STORE-31).
    ``use_collectives=False`` (torch's per-rank mode, API-9) is refused.
    """
    _path(checkpoint_id, storage_writer, "storage_writer")
    if not use_collectives:
        raise ValueError(
            "refdcp.reference.save does not implement use_collectives=False (API-9); "
            "use refdcp.save"
        )
    c = communicator(comm, process_group, no_dist)
    writer = storage_writer or ReferenceWriter(checkpoint_id)
    planner = planner or ReferenceSavePlanner()
    steps = SaveSteps(
        c.rank,
        c.world_size,
        c.rank == c.coordinator_rank,
        state_dict,
        writer,
        planner,
        checkpoint_id,
    )
    try:
        metadata: Metadata = drive(SAVE, steps, c, fault=fault, observer=observer)
    except CheckpointError as exc:
        abort = getattr(writer, "abort_save", None)  # refdcp's clean-up call (PROTO-16)
        if exc.committed is False and abort is not None:
            abort()  # nothing was committed: the writer removes what it wrote (STORE-31)
        raise
    return metadata


@functools.partial(TorchCallForms, keyword="storage_reader")
def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Any = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    comm: Communicator | None = None,
    verify: bool | None = None,
    safe_globals: Sequence[Any] = (),
    fault: FaultHook | None = None,
    observer: Observer | None = None,
    atomic: bool = False,
    read_once: bool | Literal["auto"] | None = None,
) -> None:
    """Load into ``state_dict`` in place, resharding as needed (API-1, API-2).

    ``verify`` as LOAD-10/API-6; ``safe_globals`` extends the reference load
    planner's allow-list (LOAD-8); ``atomic=True`` leaves every destination as
    it was when the load fails (LOAD-21). ``read_once`` is checked and ignored:
    each rank reads what it needs, which loads the same values (ONCE-6).
    """
    _path(checkpoint_id, storage_reader, "storage_reader")
    if read_once not in (None, True, False, "auto"):
        raise ValueError(f"read_once must be True, False or 'auto', not {read_once!r}")
    c = communicator(comm, process_group, no_dist)
    reader = storage_reader or ReferenceReader(checkpoint_id)
    planner = planner or ReferenceLoadPlanner()
    if safe_globals:
        if not isinstance(planner, ReferenceLoadPlanner):
            raise ValueError(
                f"safe_globals= applies to the reference load planner; {type(planner).__name__} "
                "unpickles objects itself"
            )
        planner.safe_globals = [*planner.safe_globals, *safe_globals]
    steps = LoadSteps(
        c.rank,
        c.world_size,
        c.rank == c.coordinator_rank,
        state_dict,
        reader,
        planner,
        checkpoint_id,
        verify,
        atomic,
    )
    try:
        drive(LOAD, steps, c, fault=fault, observer=observer)
    except BaseException as exc:
        for line in steps.roll_back():  # atomic=True: every destination as it was (LOAD-21)
            exc.add_note(line)
        raise
