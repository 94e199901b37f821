"""Replica digests shared with a helper thread give exactly DEDUP-6's checksums (DEDUP-16)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pytest
import torch

import refdcp.crc.pieces as crc_pieces
from refdcp.crc.kernel import KERNELS, crc32c
from refdcp.crc.pieces import HELPER_PIECE_BYTES, crc32c_each
from refdcp.planning.local_plan import replica_checksums, save_items, tensor_checksum

P = HELPER_PIECE_BYTES
SIZES = [0, 1, 4095, P - 1, P, P + 1, 2 * P + 3, 9 * P + 7]


def _views() -> list[memoryview]:
    g = torch.Generator().manual_seed(5)
    return [
        memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy()).cast("B")
        for n in SIZES
    ]


class _AtSubmit(Executor):
    """Runs the helper to its end when it is submitted: it computes every piece."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


class _Never(Executor):
    """A pool whose threads are all busy: the helper never starts."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return Future()


class _Thread(Executor):
    """The helper on its own thread, as the real pool runs it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        threading.Thread(target=lambda: fut.set_result(fn(*args, **kwargs)), name="helper").start()
        return fut


@pytest.mark.spec("DEDUP-16", "INTEG-11")
@pytest.mark.parametrize(
    "pool", [_AtSubmit, _Never, _Thread, None], ids=["helper-all", "never", "thread", "inline"]
)
def test_each_buffer_gets_its_exact_crc_whoever_computes_the_pieces(
    monkeypatch: pytest.MonkeyPatch, pool: type[Executor] | None
) -> None:
    views = _views()
    monkeypatch.setattr(crc_pieces, "EACH_SHARE_MIN_BYTES", 0)
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: None if pool is None else pool())
    expect = [KERNELS["crc32c"](v) for v in views]
    assert crc32c_each(views) == expect
    assert crc32c_each(list(reversed(views))) == list(reversed(expect))
    assert crc32c_each([]) == []


@pytest.mark.spec("DEDUP-16")
def test_an_error_in_the_helper_fails_the_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    real = crc_pieces.crc32c

    def failing_in_helper(data: Any, value: int = 0) -> int:
        if threading.current_thread().name == "helper":
            raise MemoryError("helper could not read")
        return real(data, value)

    monkeypatch.setattr(crc_pieces, "crc32c", failing_in_helper)
    monkeypatch.setattr(crc_pieces, "EACH_SHARE_MIN_BYTES", 0)

    def at_submit_on_helper_thread() -> Executor:
        class OnHelper(Executor):
            def submit(self, fn: Callable[..., Any], /, *a: Any, **k: Any) -> Future[Any]:
                t = threading.Thread(target=fn, name="helper")
                t.start()
                t.join()  # the helper takes its first piece before this thread takes any
                return Future()

        return OnHelper()

    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", at_submit_on_helper_thread)
    with pytest.raises(MemoryError, match="helper could not read"):
        crc32c_each(_views())


@pytest.mark.spec("DEDUP-16", "DEDUP-6", "DEDUP-13")
@pytest.mark.parametrize("pool", [_AtSubmit, _Thread, None], ids=["helper-all", "thread", "inline"])
def test_replica_digests_are_the_tensor_checksums_in_item_order(
    monkeypatch: pytest.MonkeyPatch, pool: type[Executor] | None
) -> None:
    monkeypatch.setattr(crc_pieces, "EACH_SHARE_MIN_BYTES", 0)
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: None if pool is None else pool())
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * P // 4 + 5, generator=g)  # several pieces
    sd: dict[str, Any] = {
        "small": torch.arange(10.0),
        "empty": torch.zeros(0),
        "mid": torch.randn(70_000, generator=g),  # >= 64 KiB: shared
        "big": big,
        "t": torch.randn(300, 400, generator=g).t(),  # not contiguous: copied first
        "conj": torch.randn(4, dtype=torch.complex64, generator=g).conj(),
        "obj": {"step": 3},
    }
    items = save_items(sd)
    got = replica_checksums(sd, items)
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert {k[0]: v for k, v in got.items() if k[0] in tensors} == {
        k: tensor_checksum(v) for k, v in tensors.items()
    }
    assert [k[0] for k in got] == [i.index.fqn for i in items]  # the items' order
    assert got[next(k for k in got if k[0] == "big")] == crc32c(big.numpy().tobytes())
