"""Read-once loads over NCCL (spec/read_once.md, ONCE-7, ONCE-9, COMM-63); run by ``make test-gpu``.

The pieces travel in the read outcomes' all-gather, which ``TorchDistComm`` moves
through the GPU under NCCL. ``read_once=True`` must give the Gloo results (each
stored byte read once, bit-exact); ``"auto"`` stays off under NCCL even on a
shared file system (ONCE-9).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

import refdcp
from refdcp.testing.spawn import run_gloo
from refdcp.testing.storage_wrappers import CountingReader
from tests.test_read_once import _bytes, _gloo_load, _saved_for_gloo, _state, _values

SINGLE_PATH = "read-once over NCCL (ONCE-7, ONCE-9) is a bandwidth feature of the default path; run by make test-gpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason="multi-rank NCCL needs at least 2 GPUs (one rank per GPU); fewer are visible",
    ),
]


def _auto_on_a_shared_fs(rank: int, world: int, path: str) -> Any:
    from refdcp.storage.fs import mounts

    real = os.path.realpath(path)
    mounts.mount_table = lambda: [("/", "ext4"), (real, "nfs4")]  # type: ignore[assignment]
    layout = [(f"w{i}", "replicated", (1024, 1024), torch.float32) for i in range(4)]
    layout.append(("step", "object", (), None))
    sd = _state(layout, world, rank, False)
    reader = CountingReader(refdcp.FileSystemReader(path))
    refdcp.load(sd, storage_reader=reader)  # read_once="auto"
    exact = all(_bytes(sd[n]) == _bytes(_values(n, s, d)) for n, k, s, d in layout if k != "object")
    return reader.bytes_read, exact


@pytest.mark.spec("ONCE-7", "COMM-63")
def test_nccl_read_once_reads_each_byte_once_bit_exact() -> None:
    world = min(torch.cuda.device_count(), 4)
    with tempfile.TemporaryDirectory() as d:
        path, stored = _saved_for_gloo(d)
        got = run_gloo(world, _gloo_load, path, "load", timeout=300, backend="nccl")
        assert sum(b for b, _ in got) == stored and all(ok for _, ok in got)


@pytest.mark.spec("ONCE-9")
def test_nccl_auto_reads_on_every_rank_even_on_a_shared_file_system() -> None:
    world = min(torch.cuda.device_count(), 4)
    with tempfile.TemporaryDirectory() as d:
        path, stored = _saved_for_gloo(d)
        got = run_gloo(world, _auto_on_a_shared_fs, path, timeout=300, backend="nccl")
        assert [b for b, _ in got] == [stored] * world and all(ok for _, ok in got)
