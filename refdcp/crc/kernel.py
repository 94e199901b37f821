"""CRC-32C, the checksum refdcp records for items and metadata (INTEG-1, INTEG-2, INTEG-9).

``crc32c(data, value)`` continues the CRC ``value`` over ``data``: the standard
CRC-32C (Castagnoli, iSCSI, RFC 3720) that every refdcp checkpoint carries.
The kernel is ``fastcrc``'s when installed (carry-less-multiply folding, about
40-60 GB/s on cache-resident data with AVX-512, 15 GB/s from memory, measured
on the benchmark VM), else the ``crc32c`` package's (the SSE4.2 ``crc32``
instruction, 3 streams: 27 GB/s cache-resident, 6-12 GB/s from memory). Both
compute the same values and release the GIL on large buffers, so the choice
changes speed only, never a stored or checked value.
"""

from __future__ import annotations

from typing import Protocol

import crc32c as _crc32c_pkg
from typing_extensions import Buffer

__all__ = ["KERNEL", "KERNELS", "CrcFunction", "crc32c", "crc32c_small"]


class CrcFunction(Protocol):
    """``f(data, value=0) -> int``: the CRC-32C of ``data`` continued from ``value``."""

    def __call__(self, data: Buffer, value: int = 0, /) -> int: ...


def _crc32c_package(data: Buffer, value: int = 0, /) -> int:
    return int(_crc32c_pkg.crc32c(data, value))


#: every kernel importable here, by name (the tests check that they agree)
KERNELS: dict[str, CrcFunction] = {"crc32c": _crc32c_package}

try:
    from fastcrc import crc32 as _fastcrc32
except ImportError:  # pragma: no cover - a dependency; refdcp stays correct without it
    pass
else:
    KERNELS["fastcrc"] = _fastcrc32.iscsi

#: the kernel ``crc32c`` is: the fastest importable one
KERNEL = "fastcrc" if "fastcrc" in KERNELS else "crc32c"
crc32c: CrcFunction = KERNELS[KERNEL]
#: the same CRC-32C with the cheapest call, for many small buffers (the crc32c package's own
#: function: no wrapper; its values are KERNELS["crc32c"]'s)
crc32c_small: CrcFunction = _crc32c_pkg.crc32c
