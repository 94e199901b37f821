"""Round 3 of the conformance suite: the coverage model (pairwise cases), containment, the
caller's state and the async path (CONF-61..68). Each broken backend below has its defect at
one dimension point or obligation and fails the requirement naming it with exit status 1;
the correct backends of tests/ pass every new check."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import threading
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from conformance.backend import Capabilities
from conformance.cli import conformance_command
from conformance.coverage import DIMENSIONS, SEED, cases_for, domains_for, pairwise
from conformance.examples.dict_backend import DictBackend, DictReader, DictWriter
from conformance.registry import Result
from conformance.runner import run_checks
from tests.test_conformance_blind_spots import _Transforming, by_id, with_reader, with_writer
from tests.test_conformance_fragility import rank_local_backend
from tests.test_conformance_power_loss import PosixBackend, SyncedFileWriter

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

NEW = ["CONF-61", "CONF-62", "CONF-63", "CONF-64", "CONF-65", "CONF-66", "CONF-67"]


# --- the model: every pair of values, seeded, within the capabilities ---------------------------


@pytest.mark.spec("CONF-61", "CONF-55")
@settings(max_examples=12, deadline=None)
@given(
    shared=st.booleans(),
    threads=st.booleans(),
    overwrite=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pairwise_cases_cover_every_pair_the_capabilities_allow(
    shared: bool, threads: bool, overwrite: bool, seed: int
) -> None:
    caps = Capabilities(shared_location=shared, thread_count=threads, overwrite=overwrite)
    domains = domains_for(caps)
    cases = pairwise(domains, seed)
    assert cases == pairwise(domains, seed)  # reproducible
    for a, b in combinations(domains, 2):
        seen = {(c[a], c[b]) for c in cases}
        assert seen == {(x, y) for x in domains[a] for y in domains[b]}, (a, b)
    for c in cases:
        assert all(c[d] in domains[d] for d in domains)
    assert (not shared) <= all(c["ranks"] == 1 for c in cases)
    assert (not threads) <= all(c["thread_count"] == 1 for c in cases)
    assert (not overwrite) <= all(c["overwrite"] == "fresh" for c in cases)
    # greedy pairwise stays near the product of the two largest domains, far below the full cross
    sizes = sorted(len(v) for v in domains.values())
    assert len(cases) <= 2 * sizes[-1] * sizes[-2]


@pytest.mark.spec("CONF-61")
def test_the_default_cases_are_fixed_by_the_seed() -> None:
    caps = Capabilities(thread_count=True)
    assert [c.values for c in cases_for(caps)] == [c.values for c in cases_for(caps, SEED)]
    assert set(DIMENSIONS) >= {"ranks", "thread_count", "size", "chunks", "keys", "reuse", "load"}


# --- broken backends, one defect at one point each ------------------------------------------


class ThreadsLargeWriter(_Transforming):
    """Drops the last 4 KiB of a tensor over 1 MiB, but only when writing with several threads
    (a part-upload bug of the parallel path)."""

    def transform(self, t: torch.Tensor) -> torch.Tensor:
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        if self.thread_count > 1 and raw.numel() > 2**20:
            raw = raw.clone()
            raw[-4096:] = 0
            return raw.view(t.dtype).reshape(t.shape)
        return t


class ByFqnWriter(DictWriter):
    """Names each blob by its FQN, so several chunks of one FQN overwrite each other."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        out = []
        with self.store.lock:
            for r in results:
                name = f"{self.save_id}/{r.index.fqn}"
                self.store.staged[(self.location, name)] = self.store.staged.pop(
                    (self.location, r.storage_data)
                )
                out.append(dataclasses.replace(r, storage_data=name))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(out)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        names = {r.storage_data for rs in results for r in rs}
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        import pickle

        with self.store.lock:
            blobs = {n: self.store.staged.pop((self.location, n)) for n in names}
            self.store.committed[self.location] = (pickle.dumps(metadata), blobs)


class AsciiKeyWriter(DictWriter):
    """Encodes each FQN as ASCII for its object names: unicode keys break the save."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        for item in plan.items:
            item.index.fqn.encode("ascii")
        return super().write_data(plan, planner)


class StaleOnRank1Reader(DictReader):
    """Keeps the storage index of the first checkpoint it read when reused as rank 1."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if kwargs.get("rank") == 1 and self.storage_data:
            return  # the defect: rank 1 never refreshes what reset() should have dropped
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class PositionalReader(DictReader):
    """Reads the n-th blob of the save for the n-th read item: a subset load gets shifted data."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ordered = sorted(set(self.storage_data.values()), key=lambda n: int(n.rsplit("_", 1)[1]))
        by_rank: dict[str, list[str]] = {}
        for name in ordered:
            by_rank.setdefault(name.split("/")[1].split("_")[0], []).append(name)
        for i, item in enumerate(plan.items):
            own = self.storage_data[item.storage_index]
            names = by_rank[own.split("/")[1].split("_")[0]]
            self.storage_data[item.storage_index] = names[min(i, len(names) - 1)]
        return super().read_data(plan, planner)


class SiblingFileWriter(SyncedFileWriter):
    """Keeps an index of its saves in a file next to the location, outside it."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        with open(f"{self.location}.index", "a", encoding="utf-8") as f:
            f.write(self.save_id + "\n")


class ByteSwapWriter(DictWriter):
    """Encodes every tensor big-endian by swapping its bytes in the caller's memory."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        outer = self

        class Swapping:
            def resolve_data(self, item: Any) -> Any:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor) and data.element_size() > 1:
                    flat = data.detach().view(-1).view(torch.uint8)
                    flat.copy_(flat.view(-1, data.element_size()).flip(1).reshape(-1))
                    swapped = data.detach().clone()
                    raw = swapped.view(-1).view(torch.uint8)
                    raw.copy_(raw.view(-1, data.element_size()).flip(1).reshape(-1))
                    return swapped  # what is stored is right; the caller's tensor is not
                return data

        del outer
        return super().write_data(plan, Swapping())  # type: ignore[arg-type]


class LockedFileWriter(SyncedFileWriter):
    """Holds a lock, so it cannot be pickled for torch's process executor."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.lock = threading.Lock()


class ThreadLocalClientWriter(DictWriter):
    """Keeps its storage client in a thread-local made in ``__init__``: only the thread that
    built the writer has one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.local = threading.local()
        self.local.client = self.store

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.store = self.local.client
        return super().write_data(plan, planner)


class SharedStagingWriter(DictWriter, AsyncStager):
    """An AsyncStager whose ``stage`` moves tensors to the CPU with ``.cpu()``: a no-op for CPU
    tensors, so the "staged" dict shares the caller's memory."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


class TorchFutureStagingWriter(DictWriter, AsyncStager):
    """An AsyncStager whose ``stage`` returns a ``torch.futures.Future``, which torch's
    async_save does not recognise as a staging future."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> Any:
        fut: Future[dict[str, Any]] = Future()
        fut.set_result({k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in state_dict.items()})
        return fut


def broken_threads_large() -> DictBackend:
    return with_writer(ThreadsLargeWriter)


def broken_chunks_by_fqn() -> DictBackend:
    return with_writer(ByFqnWriter)


def broken_unicode_keys() -> DictBackend:
    return with_writer(AsciiKeyWriter)


def broken_reader_reuse_rank1() -> DictBackend:
    return with_reader(StaleOnRank1Reader)


def broken_subset_load() -> DictBackend:
    return with_reader(PositionalReader)


def broken_sibling_file() -> PosixBackend:
    return PosixBackend(SiblingFileWriter, "writes a sibling file")


def broken_byte_swap() -> DictBackend:
    return with_writer(ByteSwapWriter)


def broken_unpicklable() -> PosixBackend:
    return PosixBackend(LockedFileWriter, "holds a lock")


def broken_thread_local() -> DictBackend:
    return with_writer(ThreadLocalClientWriter)


def broken_shared_staging() -> DictBackend:
    return with_writer(SharedStagingWriter)


def broken_torch_future_staging() -> DictBackend:
    return with_writer(TorchFutureStagingWriter)


#: (factory, requirement, words the reason must hold: the dimension point that sets it apart)
EXIT_CASES = [
    ("broken_threads_large", "CONF-61", ("thread_count=4", "size=6MiB+4")),
    ("broken_chunks_by_fqn", "CONF-61", ("chunk",)),
    ("broken_unicode_keys", "CONF-61", ("keys=unicode", "UnicodeEncodeError")),
    ("broken_reader_reuse_rank1", "CONF-61", ("readers reused", "rank 1's read_data")),
    ("broken_subset_load", "CONF-61", ("load",)),
    ("broken_sibling_file", "CONF-62", ("ckpt.index", "expected changes only at or below")),
    ("broken_byte_swap", "CONF-63", ("changed the caller's tensors", "before")),
    ("broken_unpicklable", "CONF-64", ("cannot pickle", "PROCESS")),
    ("broken_thread_local", "CONF-65", ("executor thread", "AttributeError", "raised in the backend")),
    ("broken_shared_staging", "CONF-66", ("changed after staging completed",)),
    ("broken_torch_future_staging", "CONF-67", ("torch.futures.Future",)),
]


@pytest.mark.spec("CONF-61", "CONF-62", "CONF-63", "CONF-64", "CONF-65", "CONF-66", "CONF-67",
                  "CONF-68", "CONF-42")
@pytest.mark.parametrize(("factory", "requirement", "words"), EXIT_CASES,
                         ids=[c[0] for c in EXIT_CASES])
def test_each_broken_backend_exits_1_naming_its_point(
    factory: str, requirement: str, words: tuple[str, ...], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "r.json"
    target = f"tests.test_conformance_coverage:{factory}"
    rc = conformance_command(target, json_path=str(out), examples=2, only=[requirement])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    (result,) = json.loads(out.read_text())["results"]
    assert result["id"] == requirement and result["status"] == "fail", result
    assert result["reason"].startswith(requirement), result["reason"]
    for w in words:
        assert w in result["reason"], (w, result["reason"])


@pytest.mark.spec("CONF-61", "CONF-68")
@pytest.mark.slow  # long; make test-thorough runs it
def test_the_crossed_defect_is_invisible_to_the_single_point_checks() -> None:
    """The threads x size defect passes CONF-19 (threads, small items) and CONF-46 (sizes, one
    thread): only the crossed cases see it, and the reason says which values set it apart."""
    results = by_id(run_checks(broken_threads_large(), only={"CONF-19", "CONF-46", "CONF-61"}))
    assert results["CONF-19"].status == "pass" and results["CONF-46"].status == "pass"
    reason = results["CONF-61"].reason
    assert "every failing case has" in reason and "no passing case has both" in reason, reason
    assert "item of 6.0 MiB" in reason and "read 0x" in reason and "saved 0x" in reason, reason


@pytest.mark.spec("CONF-62", "CONF-63")
def test_a_reuse_writing_into_the_old_location_breaks_containment() -> None:
    """A writer that ignores reset() writes into the location it was built for: CONF-62
    reports the neighbouring checkpoint it damaged or the files it touched there."""

    class IgnoresReset(SyncedFileWriter):
        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(None)

    result = run_checks(PosixBackend(IgnoresReset, "ignores reset"), only={"CONF-62"})[0]
    assert result.status == "fail" and result.reason.startswith("CONF-62"), result.reason
    assert "reused through reset()" in result.reason, result.reason


# --- correct backends pass every new check -----------------------------------------------------


def _failures(results: list[Result]) -> list[tuple[str, str]]:
    return [(r.id, r.reason[:300]) for r in results if r.status == "fail"]


@pytest.mark.spec("CONF-61", "CONF-62", "CONF-63", "CONF-65", "CONF-66", "CONF-55")
@pytest.mark.parametrize(
    "factory",
    [DictBackend, rank_local_backend, lambda: PosixBackend(SyncedFileWriter, "synced")],
    ids=["example", "rank-local", "posix"],
)
def test_correct_backends_pass_the_new_checks(factory: Any) -> None:
    results = run_checks(factory(), only=set(NEW))
    assert not _failures(results), _failures(results)
    assert {r.id for r in results} == set(NEW)


@pytest.mark.spec("CONF-64", "CONF-67")
def test_the_async_checks_apply_where_they_should() -> None:
    posix = by_id(run_checks(PosixBackend(SyncedFileWriter, "synced"), only={"CONF-64", "CONF-67"}))
    assert posix["CONF-64"].status == "pass"
    assert posix["CONF-67"].status == "n/a" and "not an AsyncStager" in posix["CONF-67"].reason
    example = by_id(run_checks(DictBackend(), only={"CONF-64"}))
    assert example["CONF-64"].status == "n/a" and "process_async" in example["CONF-64"].reason


@pytest.mark.spec("CONF-67")
def test_a_correct_async_stager_passes_conf_66_and_67() -> None:
    class CopyingStager(DictWriter, AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict: dict[str, Any]) -> Any:
            pool = concurrent.futures.ThreadPoolExecutor(1)
            staged = pool.submit(
                lambda: {k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in state_dict.items()}
            )
            pool.shutdown(wait=False)
            return staged

    results = run_checks(with_writer(CopyingStager), only={"CONF-66", "CONF-67"})
    assert [r.status for r in results] == ["pass", "pass"], _failures(results)


@pytest.mark.spec("CONF-15", "CONF-68")
def test_a_resharding_error_inside_torch_is_reported_with_its_boxes() -> None:
    class WrongShapeReader(DictReader):
        """Returns the whole stored chunk whatever box was asked for."""

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            for item in plan.items:
                raw = self.blobs[self.storage_data[item.storage_index]]
                stored = torch.load(io.BytesIO(raw), weights_only=True)
                planner.resolve_tensor(item).detach().copy_(stored)
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

    result = run_checks(with_reader(WrongShapeReader), only={"CONF-15"})[0]
    assert result.status == "fail"
    assert "one rank loading w (9, 7) boxes at (0, 0) of (4, 7)" in result.reason, result.reason
    assert "(raised in" in result.reason and "expected exactly those sub-boxes" in result.reason
