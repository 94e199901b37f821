"""Ground truth: the suite's own copies of what it saved, and bit-exact comparison (CONF-40).

Every expected value is cloned before the backend sees it, and every loaded
value is compared with that clone byte for byte, so a writer and a reader
that are wrong in the same way still fail.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from conformance.registry import CheckFailed

__all__ = ["DTYPES", "assert_same", "blank_like", "bits", "clone_truth", "rand_tensor"]

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def rand_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (every bit pattern, NaNs included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    """The tensor's logical contents as raw bytes."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def blank_like(t: torch.Tensor) -> torch.Tensor:
    """A destination of the same shape and dtype whose every byte differs from ``t``'s."""
    raw = bits(t)
    if not raw:
        return torch.empty(t.shape, dtype=t.dtype)
    if t.dtype == torch.bool:
        return ~t.detach().clone()
    flipped = torch.frombuffer(bytearray(raw), dtype=torch.uint8) ^ 0xA5
    return flipped.view(t.dtype).reshape(t.shape).clone()


def clone_truth(sd: dict[str, Any]) -> dict[str, Any]:
    """A deep, independent copy of ``sd``: tensors cloned, BytesIO copied."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        elif isinstance(v, io.BytesIO):
            out[k] = v.getvalue()
        else:
            out[k] = v
    return out


def assert_same(loaded: dict[str, Any], truth: dict[str, Any], requirement: str) -> None:
    """Raise CheckFailed naming ``requirement`` unless every key matches bit for bit."""
    missing = sorted(set(truth) - set(loaded))
    if missing:
        raise CheckFailed(f"{requirement}: keys not loaded: {missing[:5]}")
    for k, want in truth.items():
        got = loaded[k]
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                raise CheckFailed(f"{requirement}: {k!r} loaded as {type(got).__name__}")
            if got.dtype != want.dtype or got.shape != want.shape:
                raise CheckFailed(
                    f"{requirement}: {k!r} is {got.dtype}{tuple(got.shape)}, "
                    f"saved {want.dtype}{tuple(want.shape)}"
                )
            if bits(got) != bits(want):
                raise CheckFailed(f"{requirement}: {k!r} differs from what was saved")
        elif isinstance(want, bytes):
            value = got.getvalue() if isinstance(got, io.BytesIO) else got
            if value != want:
                raise CheckFailed(f"{requirement}: bytes item {k!r} differs from what was saved")
        elif got != want:
            raise CheckFailed(f"{requirement}: object {k!r} is {got!r}, saved {want!r}")
