"""Ground truth: the suite's own copies of what it saved, and bit-exact comparison (CONF-40).

Every expected value is cloned before the backend sees it, and every loaded
value is compared with that clone byte for byte, so a writer and a reader
that are wrong in the same way still fail.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from conformance.registry import CheckFailed

__all__ = [
    "DTYPES",
    "assert_same",
    "bits",
    "blank_like",
    "clone_truth",
    "finite_tensor",
    "rand_tensor",
    "special_values",
]

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


def finite_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random finite values for floating and complex dtypes, random bits otherwise.

    Every check but CONF-10 saves these, so a writer that alters special values
    (NaN payloads, infinities, subnormals) fails CONF-10 alone (CONF-52).
    """
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.complex128).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return rand_tensor(shape, dtype, gen)


#: floating dtype -> (unsigned integer dtype of its width, exponent bits, mantissa bits)
_LAYOUT: dict[torch.dtype, tuple[Any, int, int]] = {
    torch.float64: (np.uint64, 11, 52),
    torch.float32: (np.uint32, 8, 23),
    torch.float16: (np.uint16, 5, 10),
    torch.bfloat16: (np.uint16, 8, 7),
    torch.float8_e4m3fn: (np.uint8, 4, 3),
    torch.float8_e5m2: (np.uint8, 5, 2),
}


def _patterns(exp_bits: int, man_bits: int) -> list[int]:
    """Bit patterns: both zeros, subnormals, extreme normals, infinities and NaNs with
    distinct payloads (quiet and signalling), each with both signs."""
    e_max, m_max, quiet = (1 << exp_bits) - 1, (1 << man_bits) - 1, 1 << (man_bits - 1)
    alternating = int("01" * man_bits, 2) & m_max
    fields = [
        (0, 0),  # +-0
        (0, 1),  # smallest subnormal
        (0, m_max),  # largest subnormal
        (0, quiet),
        (1, 0),  # smallest normal
        (e_max - 1, m_max),  # largest finite
        (e_max, 0),  # +-inf (a normal number in float8_e4m3fn)
        (e_max, 1),  # signalling NaN, smallest payload
        (e_max, quiet),  # the canonical quiet NaN
        (e_max, quiet | 1),  # quiet NaN with a payload
        (e_max, alternating),
        (e_max, m_max ^ quiet),  # signalling NaN, largest payload
        (e_max, m_max),
    ]
    out: list[int] = []
    for sign in (0, 1):
        for exp, man in fields:
            value = (sign << (exp_bits + man_bits)) | (exp << man_bits) | man
            if value not in out:
                out.append(value)
    return out


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """A 1-d tensor of ``dtype`` holding the special bit patterns of ``_patterns`` (CONF-10).

    Complex dtypes pair the patterns of their component type as (real, imaginary)
    in shifted order, so every pattern appears in both parts.
    """
    if dtype.is_complex:
        part = special_values(torch.float64 if dtype == torch.complex128 else torch.float32)
        pairs = torch.stack([part, part.roll(5)], dim=1).contiguous()
        return pairs.view(dtype).reshape(-1)
    uint, exp_bits, man_bits = _LAYOUT[dtype]
    raw = np.array(_patterns(exp_bits, man_bits), dtype=uint)
    return torch.from_numpy(raw.view(np.uint8).copy()).view(dtype)


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


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where ``got`` first differs from ``want``, as observed (CONF-52)."""
    a, b = bits(got), bits(want)
    size = max(1, want.element_size())
    n_bad = sum(1 for i in range(0, len(b), size) if a[i : i + size] != b[i : i + size])
    first = next(i for i in range(len(b)) if a[i] != b[i])
    elem = first // size
    got_e = a[elem * size : (elem + 1) * size].hex()
    want_e = b[elem * size : (elem + 1) * size].hex()
    return (
        f"({want.dtype}, {len(b)} bytes) differs from what was saved: {n_bad} of "
        f"{len(b) // size} elements differ, first at byte {first} (element {elem}: "
        f"read 0x{got_e}, saved 0x{want_e})"
    )


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
                raise CheckFailed(f"{requirement}: {k!r} {_first_difference(got, want)}")
        elif isinstance(want, bytes):
            value = got.getvalue() if isinstance(got, io.BytesIO) else got
            if value != want:
                raise CheckFailed(f"{requirement}: bytes item {k!r} differs from what was saved")
        elif got != want:
            raise CheckFailed(f"{requirement}: object {k!r} is {got!r}, saved {want!r}")
