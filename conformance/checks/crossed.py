"""Crossed checks: the pairwise cases of the coverage model (CONF-61), containment (CONF-62)
and the caller's state left untouched (CONF-63).

Every failure names the case's dimension point (``conformance.coverage.describe_case``),
what was expected and what was observed; when several cases fail, the reason also
says which dimension values every failing case shares and no passing case has.
"""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from conformance.checks.common import blank_dest, read_metadata
from conformance.coverage import (
    SEED,
    BoxLoadPlanner,
    Built,
    Case,
    ChunkSavePlanner,
    build,
    cases_for,
    describe_case,
    flatten,
    reshard_boxes,
    unfold,
)
from conformance.drive import clear_last_call, last_call, load_ranks, save_ranks
from conformance.registry import (
    CheckFailed,
    Context,
    NotApplicable,
    backend_error,
    describe,
    spec,
)
from conformance.truth import assert_same, bits, blank_like

__all__ = ["caller_state", "containment", "crossed_cases", "explain", "where"]


def where(exc: BaseException) -> str:
    """Where ``exc`` was raised, as ``(raised in torch at file:line)`` when torch raised it,
    so an error from inside torch is never the only words of a reason (CONF-61)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    return _frame_owner(frames[-1].filename, frames[-1].lineno)


_SUITE = Path(__file__).resolve().parents[1]
_BACKENDS = (_SUITE / "examples", _SUITE / "matrix", _SUITE / "backends.py")


def _frame_owner(filename: str, lineno: int | None) -> str:
    path = Path(filename).resolve()
    owner = "the backend"
    if "torch" in path.parts:
        owner = "torch"
    elif _SUITE in path.parents and not any(p == path or p in path.parents for p in _BACKENDS):
        owner = "the suite"
    return f" (raised in {owner} at {'/'.join(path.parts[-3:])}:{lineno})"


def explain(exc: BaseException) -> str:
    """``Type: message (raised in ... at file:line)``; for torch's ``CheckpointException``,
    each rank's own exception and where it was raised, which its message omits (CONF-68)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner, stack = wrapped if isinstance(wrapped, tuple) else (wrapped, None)
            at = _frame_owner(stack[-1].filename, stack[-1].lineno) if stack else ""
            parts.append(f"rank {rank}: {describe(inner)}{at}")
        return "torch's CheckpointException wrapping " + "; ".join(parts)
    return f"{describe(exc)}{where(exc)}"


class _Step(Exception):
    """A backend call of a case raised: which step, and the exception."""

    def __init__(self, step: str, exc: BaseException) -> None:
        super().__init__(step)
        self.step = step
        self.exc = exc


def _run(step: str, fn: Callable[[], Any]) -> Any:
    clear_last_call()
    try:
        return fn()
    except BaseException as exc:
        if not backend_error(exc):
            raise
        call = last_call()
        raise _Step(f"{step} ({call})" if call else step, exc) from exc


def _writers(ctx: Context, case: Case, location: Any) -> list[StorageWriter]:
    return [
        ctx.backend.writer(location, rank=r, thread_count=case["thread_count"])
        for r in range(case["ranks"])
    ]


def _save(writers: list[StorageWriter], built: Built, location: Any) -> None:
    planners = [ChunkSavePlanner(built.chunks[r], built.main.size()) for r in range(len(writers))]
    save_ranks(writers, built.sds, checkpoint_id=location, save_planners=planners)


def _prior(case: Case) -> Built | None:
    """The checkpoint a case overwrites: larger (more rows, an extra key per rank) or
    smaller (one chunk of a tiny main tensor, the heads only)."""
    if case["overwrite"] == "fresh":
        return None
    if case["overwrite"] == "over_larger":
        prior = build(case, seed=SEED * 1000 + case.number, extra_rows=7)
        for r, sd in enumerate(prior.sds):
            flat = flatten(sd)
            flat[f"{prior.main_fqn}_old_extra_r{r}"] = torch.arange(9, dtype=torch.int32)
            prior.sds[r] = unfold(flat, case)
        return prior
    small = Case(case.number, case.total, {**case.values, "size": "tiny", "chunks": 1})
    prior = build(small, seed=SEED * 1000 + case.number)
    for r, sd in enumerate(prior.sds):
        prior.sds[r] = unfold({prior.small[r][0]: flatten(sd)[prior.small[r][0]]}, case)
    return prior


def _warm(case: Case) -> Built:
    tiny = Case(case.number, case.total, {**case.values, "size": "tiny"})
    return build(tiny, seed=SEED * 2000 + case.number, variant="warm_")


def _dests(
    case: Case, built: Built, truths: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[LoadPlanner]]:
    dests: list[dict[str, Any]] = []
    planners: list[LoadPlanner] = []
    rows, cols = built.main.shape
    for r, truth in enumerate(truths):
        head, skip, tail = built.small[r]
        names = {"full": [head, skip, tail, built.main_fqn], "subset": [head, built.main_fqn, tail]}
        if case["load"] == "resharded":
            flat = {n: blank_like(truth[n]) for n in (head, skip, tail)}
            planners.append(
                BoxLoadPlanner(built.main_fqn, reshard_boxes(rows, cols, case["ranks"], r))
            )
        else:
            flat = {n: blank_like(truth[n]) for n in names[case["load"]]}
            planners.append(DefaultLoadPlanner())
        dests.append(unfold(flat, case))
    return dests, planners


def _compare(
    case: Case,
    built: Built,
    truths: list[dict[str, Any]],
    dests: list[dict[str, Any]],
    planners: list[LoadPlanner],
) -> str | None:
    for r, (truth, dest, planner) in enumerate(zip(truths, dests, planners, strict=True)):
        loaded = flatten(dest)
        try:
            assert_same(loaded, {k: truth[k] for k in loaded}, "CONF-61")
        except CheckFailed as exc:
            detail = str(exc).removeprefix("CONF-61: ")
            return f"{describe_case(case, built, rank=r)}: {detail}"
        if isinstance(planner, BoxLoadPlanner):
            for offsets, got in planner.dest.items():
                want = truth[built.main_fqn]
                for dim, (start, length) in enumerate(zip(offsets, got.shape, strict=True)):
                    want = want.narrow(dim, start, length)
                try:
                    assert_same({"box": got}, {"box": want}, "CONF-61")
                except CheckFailed as exc:
                    detail = str(exc).removeprefix("CONF-61: 'box' ")
                    return (
                        f"{describe_case(case, built, rank=r)}: box at rows {offsets[0]}.."
                        f"{offsets[0] + got.shape[0]} of {built.main_fqn!r} {detail}"
                    )
    return None


def _round_trip(ctx: Context, case: Case) -> str | None:
    """Run one case: its prior save and warm-up, the save, the metadata keys, the load and
    the comparison; the reason it fails, or None."""
    built = build(case, seed=SEED * 100 + case.number)
    truths = built.truths()
    loc, scratch = ctx.location_in_scratch()
    extra: list[Path] = [scratch]
    try:
        prior = _prior(case)
        if prior is not None:
            _run(
                f"the save of the checkpoint it overwrites ({case['overwrite']})",
                lambda: _save(_writers(ctx, case, loc), prior, loc),
            )
        writers = None
        readers: list[StorageReader] | None = None
        if case["reuse"] != "none":
            warm_loc, warm_scratch = ctx.location_in_scratch()
            extra.append(warm_scratch)
            warm = _warm(case)
            warm_writers = _writers(ctx, case, warm_loc)
            _run("the warm-up save before the reuse", lambda: _save(warm_writers, warm, warm_loc))
            if case["reuse"] in ("writer", "both"):
                writers = warm_writers
            if case["reuse"] in ("reader", "both"):
                readers = [ctx.backend.reader(warm_loc) for _ in range(case["ranks"])]
                warm_truths = warm.truths()
                warm_dests = [
                    unfold(blank_dest({k: t[k] for k in flatten(sd)}), case)
                    for t, sd in zip(warm_truths, warm.sds, strict=True)
                ]
                _run(
                    "the warm-up load before the reuse",
                    lambda: load_ranks(readers or [], warm_dests, checkpoint_id=warm_loc),
                )
        use = writers if writers is not None else _writers(ctx, case, loc)
        _run("the save", lambda: _save(use, built, loc))
        md = _run("read_metadata after the save", lambda: read_metadata(ctx, loc))
        want_keys = set().union(*(set(t) for t in truths))
        got_keys = set(md.state_dict_metadata)
        if got_keys != want_keys:
            stale = sorted(got_keys - want_keys)[:3]
            lost = sorted(want_keys - got_keys)[:3]
            return (
                f"{describe_case(case, built)}: the metadata lists keys {sorted(got_keys)[:4]}..., "
                f"expected exactly the saved keys (not saved: {stale}, missing: {lost})"
            )
        dests, planners = _dests(case, built, truths)
        use_readers = (
            readers
            if readers is not None
            else [ctx.backend.reader(loc) for _ in range(case["ranks"])]
        )
        _run(
            "the load", lambda: load_ranks(use_readers, dests, checkpoint_id=loc, planners=planners)
        )
        return _compare(case, built, truths, dests, planners)
    except _Step as failed:
        return (
            f"{describe_case(case, built)}: {failed.step} raised "
            f"{explain(failed.exc)}; expected it to succeed"
        )
    finally:
        for path in extra:
            shutil.rmtree(path, ignore_errors=True)


def _summary(req: str, cases: list[Case], failed: list[tuple[Case, str]]) -> str:
    """The first failure in full, how many cases failed, and the dimension values that set
    the failing cases apart from the passing ones."""
    bad = {c.number for c, _ in failed}
    passing = [c for c in cases if c.number not in bad]
    if not passing:
        return f"{req}: every one of the {len(cases)} cases fails. First: {failed[0][1]}"
    common = set.intersection(*(set(c.values.items()) for c, _ in failed))
    apart = [
        dv
        for dv in sorted(common, key=str)
        if not any(c.values.get(dv[0]) == dv[1] for c in passing)
    ]
    if apart:
        shared = (
            "; every failing case has "
            + " and ".join(f"{d}={v}" for d, v in apart)
            + (", no passing case does")
        )
    else:
        pairs = [
            (a, b)
            for a in sorted(common, key=str)
            for b in sorted(common, key=str)
            if str(a) < str(b)
            and not any(c.values.get(a[0]) == a[1] and c.values.get(b[0]) == b[1] for c in passing)
        ]
        shared = (
            f"; every failing case has {pairs[0][0][0]}={pairs[0][0][1]} and "
            f"{pairs[0][1][0]}={pairs[0][1][1]}, no passing case has both"
            if pairs
            else ""
        )
    return f"{req}: {len(failed)} of {len(cases)} cases fail{shared}. First: {failed[0][1]}"


@spec("CONF-61", title="pairwise crossed cases of every dimension round-trip bit-exact")
def crossed_cases(ctx: Context) -> None:
    cases = cases_for(ctx.backend.capabilities)
    failed = [(c, r) for c in cases if (r := _round_trip(ctx, c)) is not None]
    if failed:
        raise CheckFailed(_summary("CONF-61", cases, failed))


# --- containment (CONF-62) ---------------------------------------------------------------------


def location_path(location: Any) -> Path | None:
    """The local path a location names (a path, an absolute path string, a file:// URL)."""
    if isinstance(location, os.PathLike):
        return Path(os.fspath(location)).resolve()
    if isinstance(location, str):
        text = location.removeprefix("file://")
        if os.path.isabs(text):
            return Path(text).resolve()
    return None


Tree = dict[str, tuple[str, int, int, int]]


def snapshot(root: Path) -> Tree:
    """Every entry below ``root``: kind, size, inode and modification time of files."""
    out: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.join(dirpath, name)] = ("dir", 0, 0, 0)
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            out[path] = ("file", st.st_size, st.st_ino, st.st_mtime_ns)
    return out


def _outside(before: Tree, after: Tree, allowed: Path, root: Path) -> list[str]:
    seen = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) == after.get(path):
            continue
        p = Path(path).resolve()
        if p == allowed or allowed in p.parents:
            continue
        what = "created" if path not in before else "deleted" if path not in after else "modified"
        seen.append(f"{what} {p.relative_to(root.resolve())}")
    return seen


def _small(case: Case, seed: int) -> Built:
    tiny = Case(
        case.number,
        case.total,
        {**case.values, "size": "tiny", "ranks": 1, "chunks": 1, "keys": "short"},
    )
    return build(tiny, seed=seed, variant="neighbour_")


@spec("CONF-62", title="a save writes nothing outside its location")
def containment(ctx: Context) -> None:
    cases = cases_for(ctx.backend.capabilities)
    failed: list[tuple[Case, str]] = []
    errors: list[str] = []
    for case in cases:
        made: list[Path] = []
        try:
            reason = _contained(ctx, case, made, errors)
        finally:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
        if reason is not None:
            failed.append((case, reason))
    if failed:
        raise CheckFailed(_summary("CONF-62", cases, failed))
    if len(errors) == len(cases):
        raise NotApplicable(f"CONF-62 cannot be judged: every save failed; first: {errors[0]}")


def _contained(ctx: Context, case: Case, made: list[Path], errors: list[str]) -> str | None:
    neighbour = _small(case, SEED * 3000 + case.number)
    n_loc, n_scratch = ctx.location_in_scratch()
    made.append(n_scratch)
    one = Case(case.number, case.total, {**case.values, "ranks": 1, "thread_count": 1})
    try:
        _save(_writers(ctx, one, n_loc), neighbour, n_loc)
    except BaseException as exc:
        if not backend_error(exc):
            raise
        errors.append(explain(exc))
        return None
    built = build(case, seed=SEED * 100 + case.number)
    loc, scratch = ctx.location_in_scratch()
    made.append(scratch)
    prior = _prior(case)
    writers = _writers(ctx, case, n_loc if case["reuse"] in ("writer", "both") else loc)
    try:
        if prior is not None:
            _save(_writers(ctx, case, loc), prior, loc)
        before = snapshot(ctx.root)
        _save(writers, built, loc)
    except BaseException as exc:
        if not backend_error(exc):
            raise
        errors.append(explain(exc))
        before = {}
    path = location_path(loc)
    allowed = path if path is not None and ctx.root.resolve() in path.parents else scratch.resolve()
    if before:
        seen = _outside(before, snapshot(ctx.root), allowed, ctx.root)
        if seen:
            rel = allowed.relative_to(ctx.root.resolve())
            return (
                f"{describe_case(case, built)}: the save at {rel} "
                f"{', '.join(seen[:4])}{' ...' if len(seen) > 4 else ''}; expected changes "
                f"only at or below {rel}"
            )
    try:
        dest = [unfold(blank_dest(t), one) for t in neighbour.truths()]
        load_ranks([ctx.backend.reader(n_loc)], dest, checkpoint_id=n_loc)
        assert_same(flatten(dest[0]), neighbour.truths()[0], "CONF-62")
    except CheckFailed as exc:
        return (
            f"{describe_case(case, built)}: after the save, the neighbouring checkpoint "
            f"(the one its writers were built for when reused) is no longer what was saved "
            f"there: {str(exc).removeprefix('CONF-62: ')}"
        )
    except BaseException as exc:
        if not backend_error(exc):
            raise
        return (
            f"{describe_case(case, built)}: after the save, loading the neighbouring checkpoint "
            f"raised {explain(exc)}; expected it unchanged and loadable"
        )
    return None


# --- the caller's state (CONF-63) --------------------------------------------------------------


def _fingerprint(built: Built) -> dict[str, bytes]:
    out = {
        k: bits(v)
        for r, sd in enumerate(built.sds)
        for k, v in ((f"rank {r}: {k}", v) for k, v in flatten(sd).items())
    }
    out[f"{built.main_fqn} (the tensor the chunks are views of)"] = bits(built.main)
    return out


@spec("CONF-63", title="a save leaves the caller's state dict bit-identical")
def caller_state(ctx: Context) -> None:
    cases = cases_for(ctx.backend.capabilities)
    failed: list[tuple[Case, str]] = []
    errors: list[str] = []
    for case in cases:
        built = build(case, seed=SEED * 100 + case.number)
        before = _fingerprint(built)
        loc, scratch = ctx.location_in_scratch()
        try:
            _save(_writers(ctx, case, loc), built, loc)
        except BaseException as exc:
            if not backend_error(exc):
                raise
            errors.append(explain(exc))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        after = _fingerprint(built)
        changed = [k for k in before if before[k] != after[k]]
        if changed:
            k = changed[0]
            first = next(
                i for i, (a, b) in enumerate(zip(before[k], after[k], strict=True)) if a != b
            )
            failed.append(
                (
                    case,
                    (
                        f"{describe_case(case, built)}: the save changed the caller's tensors "
                        f"{changed[:3]}: {k} byte {first} is 0x{after[k][first]:02x} after the save, "
                        f"0x{before[k][first]:02x} before; expected every tensor bit-identical"
                    ),
                )
            )
    if failed:
        raise CheckFailed(_summary("CONF-63", cases, failed))
    if len(errors) == len(cases):
        raise NotApplicable(f"CONF-63 cannot be judged: every save failed; first: {errors[0]}")
