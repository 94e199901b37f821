"""The async path: a backend used under torch's ``async_save`` (CONF-64..67).

torch's ``async_save`` stages the state dict (the writer's own ``stage`` when the
writer is an ``AsyncStager``, else a copy into CPU memory), then runs the whole
save in a background thread (``AsyncCheckpointerType.THREAD``) or sends the writer,
pickled, to a spawned process (``AsyncCheckpointerType.PROCESS``). These checks
run torch's own ``async_save`` with ``no_dist=True`` (one rank, no process group).
"""

from __future__ import annotations

import concurrent.futures
import pickle
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
from torch.distributed.checkpoint.storage import StorageWriter

from conformance.checks.common import load_into, sample_sd
from conformance.checks.crossed import explain
from conformance.drive import save_ranks
from conformance.registry import (
    CheckFailed,
    Context,
    NotApplicable,
    backend_error,
    describe,
    spec,
    tick,
)
from conformance.truth import assert_same, bits, blank_like, clone_truth

__all__ = ["process_pickling", "response_shape", "snapshot_written", "thread_executor"]

#: Seconds the suite waits on one of torch's async futures.
WAIT = 120.0


def _loads_back(ctx: Context, loc: Any, truth: dict[str, Any], req: str, point: str) -> None:
    try:
        (dest,) = load_into(ctx, loc, [truth])
    except BaseException as exc:
        if not backend_error(exc):
            raise
        raise CheckFailed(
            f"{req}: {point}: the load after the save raised {explain(exc)}; "
            "expected the saved checkpoint"
        ) from exc
    try:
        assert_same(dest, truth, req)
    except CheckFailed as exc:
        raise CheckFailed(f"{req}: {point}: {str(exc).removeprefix(req + ': ')}") from exc


@spec(
    "CONF-64",
    title="a pickled copy of the writer saves, as torch's process executor uses it",
    needs=("process_async",),
)
def process_pickling(ctx: Context) -> None:
    for used in (False, True):
        loc = ctx.location()
        writer = ctx.backend.writer(loc, rank=0)
        point = "a fresh writer"
        if used:
            first = ctx.location()
            point = "a writer that already saved once (reset to a new location)"
            save_ranks([writer], [sample_sd(641)], checkpoint_id=first)
        try:
            tick()
            copy = pickle.loads(pickle.dumps(writer))
        except BaseException as exc:
            if not backend_error(exc):
                raise
            raise CheckFailed(
                f"CONF-64: {point}: pickling and unpickling it raised {describe(exc)}; torch's "
                "async_save(async_checkpointer_type=PROCESS) sends the writer to a spawned "
                "process by pickling it, so it must survive the round trip"
            ) from exc
        if not isinstance(copy, StorageWriter):
            raise CheckFailed(
                f"CONF-64: {point}: unpickled as {type(copy).__name__}, not a StorageWriter"
            )
        sd = sample_sd(642 + used, 4)
        truth = clone_truth(sd)
        try:
            save_ranks([copy], [sd], checkpoint_id=loc)
        except BaseException as exc:
            if not backend_error(exc):
                raise
            raise CheckFailed(
                f"CONF-64: {point}: the save through its unpickled copy raised "
                f"{explain(exc)}; expected it to save like the original"
            ) from exc
        _loads_back(ctx, loc, truth, "CONF-64", f"{point}, saved through its unpickled copy")


def _wait(fut: Any, what: str, req: str, point: str) -> Any:
    try:
        return fut.result(timeout=WAIT)
    except concurrent.futures.TimeoutError as exc:
        raise CheckFailed(f"{req}: {point}: {what} did not complete within {WAIT:g} s") from exc
    except BaseException as exc:
        if not backend_error(exc):
            raise
        raise CheckFailed(
            f"{req}: {point}: {what} raised {explain(exc)}; expected it to complete"
        ) from exc


def _futures(response: Any) -> tuple[Any, Any]:
    """(staging completion or None, upload completion) of what ``async_save`` returned."""
    if isinstance(response, AsyncSaveResponse):
        return response.staging_completion, response.upload_completion
    return None, response


def _start(
    sd: dict[str, Any],
    writer: StorageWriter,
    loc: Any,
    req: str,
    point: str,
    planner: DefaultSavePlanner | None = None,
) -> tuple[Any, Any]:
    tick()
    try:
        response = async_save(
            sd, checkpoint_id=loc, storage_writer=writer, planner=planner, no_dist=True
        )
    except BaseException as exc:
        if not backend_error(exc):
            raise
        raise CheckFailed(
            f"{req}: {point}: torch's async_save raised {explain(exc)} before "
            "returning (while staging); expected it to return its futures"
        ) from exc
    tick()
    return _futures(response)


@spec("CONF-65", title="torch's async_save runs the save from its background threads")
def thread_executor(ctx: Context) -> None:
    loc1, loc2 = ctx.location(), ctx.location()
    writer = ctx.backend.writer(loc1, rank=0)
    for n, loc in enumerate((loc1, loc2)):
        point = "async_save with the thread executor, one rank (no_dist), " + (
            "the writer's first save"
            if n == 0
            else "the same writer's second save, from another executor thread"
        )
        sd = sample_sd(650 + n, 4)
        truth = clone_truth(sd)
        staging, upload = _start(sd, writer, loc, "CONF-65", point)
        if staging is not None:
            _wait(staging, "the staging future", "CONF-65", point)
        _wait(upload, "the upload future (the save in torch's executor thread)", "CONF-65", point)
        _loads_back(ctx, loc, truth, "CONF-65", point)


class _GatedPlanner(DefaultSavePlanner):
    """Holds the background save until the caller has mutated its tensors."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        if not self.gate.wait(WAIT):
            raise TimeoutError("the suite never opened the gate")
        super().set_up_planner(*args, **kwargs)


@spec("CONF-66", title="async_save writes the staged snapshot while the caller mutates")
def snapshot_written(ctx: Context) -> None:
    loc = ctx.location()
    writer = ctx.backend.writer(loc, rank=0)
    sd = sample_sd(660, 4)
    truth = clone_truth(sd)
    gate = threading.Event()
    stager = "the writer's own stage()" if isinstance(writer, AsyncStager) else "torch's stager"
    point = f"async_save (thread executor, one rank), staged by {stager}"
    try:
        staging, upload = _start(sd, writer, loc, "CONF-66", point, planner=_GatedPlanner(gate))
        if staging is not None:
            _wait(staging, "the staging future", "CONF-66", point)
        # staging is complete: the caller may now change its tensors (the next training step)
        for value in sd.values():
            if isinstance(value, torch.Tensor):
                value.copy_(blank_like(value))
    finally:
        gate.set()
    _wait(upload, "the upload future", "CONF-66", point)
    try:
        _loads_back(ctx, loc, truth, "CONF-66", point)
    except CheckFailed as exc:
        (dest,) = load_into(ctx, loc, [truth])
        mutated = [
            k
            for k, v in sd.items()
            if isinstance(v, torch.Tensor)
            and bits(dest[k]) == bits(v)
            and bits(v) != bits(truth[k])
        ]
        if mutated:
            raise CheckFailed(
                f"CONF-66: {point}: the checkpoint holds the caller's tensors {mutated[:3]} as "
                "they were changed after staging completed, not the staged snapshot; expected "
                "the values at the time of the async_save call"
            ) from exc
        raise


@spec("CONF-67", title="an AsyncStager writer's stage() returns what torch's async_save expects")
def response_shape(ctx: Context) -> None:
    loc = ctx.location()
    writer = ctx.backend.writer(loc, rank=0)
    if not isinstance(writer, AsyncStager):
        raise NotApplicable("the writer is not an AsyncStager: torch's async_save stages for it")
    sd = sample_sd(670, 4)
    truth = clone_truth(sd)
    point = "the writer's stage() called as torch's async_save calls it"
    tick()
    staged: Any = writer.stage(sd)
    tick()
    if isinstance(staged, concurrent.futures.Future):
        staged = _wait(staged, "the Future stage() returned", "CONF-67", point)
    elif not isinstance(staged, dict):
        kind = (
            "torch.futures.Future"
            if isinstance(staged, torch.futures.Future)
            else f"{type(staged).__module__}.{type(staged).__qualname__}"
        )
        raise CheckFailed(
            f"CONF-67: {point}: stage() returned {kind}; expected a state dict or a "
            "concurrent.futures.Future of one (torch's async_save hands anything else to save "
            "as if it were the state dict)"
        )
    if not isinstance(staged, dict):
        raise CheckFailed(
            f"CONF-67: {point}: the staging Future resolved to "
            f"{type(staged).__name__}; expected a state dict"
        )
    flag = writer.should_synchronize_after_execute
    if not isinstance(flag, bool):
        raise CheckFailed(
            f"CONF-67: {point}: should_synchronize_after_execute is "
            f"{type(flag).__name__}; expected a bool"
        )
    if flag:
        writer.synchronize_staging()
    if set(staged) != set(sd):
        raise CheckFailed(
            f"CONF-67: {point}: the staged state dict has keys {sorted(staged)}; "
            f"expected the given keys {sorted(sd)}"
        )
    try:
        assert_same(staged, truth, "CONF-67")
    except CheckFailed as exc:
        raise CheckFailed(f"CONF-67: {point}: the staged copy {str(exc)[9:]}") from exc
    point = "async_save with this writer (thread executor, one rank)"
    staging, upload = _start(clone_truth(sd), writer, loc, "CONF-67", point)
    if staging is not None:
        _wait(staging, "the staging completion", "CONF-67", point)
    _wait(upload, "the upload completion", "CONF-67", point)
    _loads_back(ctx, loc, truth, "CONF-67", point)
