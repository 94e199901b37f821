"""Size limits applied when reading ``.metadata`` (FMT-10, FMT-11).

The defaults are generous for real checkpoints (a 100k-item checkpoint has a
``.metadata`` of a few tens of MB with strings well under 1 KiB) and small
enough that a crafted file cannot exhaust memory. Override them per process
with ``set_metadata_limits`` or the environment variables
``REFDCP_MAX_METADATA_BYTES`` and ``REFDCP_MAX_METADATA_STRING``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = ["MetadataLimits", "get_metadata_limits", "set_metadata_limits"]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not an integer") from exc
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class MetadataLimits:
    """Caps for one ``.metadata`` read (FMT-10, FMT-11).

    ``max_file_bytes``: the largest ``.metadata`` read at all (checked with
    ``fstat`` before reading). ``max_string_chars``: the longest string (or
    bytes) anywhere in it, and the longest path a pickled ``Path`` may build.
    ``max_dims``: the most dimensions a ``torch.Size`` may have. ``max_depth``:
    the deepest nesting of containers. ``slack_units``: the amplification
    budget on top of the file size (see ``storage.metadata.safe``).
    """

    max_file_bytes: int = 1 << 30
    max_string_chars: int = 1 << 16
    max_dims: int = 256
    max_depth: int = 64
    slack_units: int = 1 << 20

    @classmethod
    def from_env(cls) -> MetadataLimits:
        d = cls()
        return cls(
            max_file_bytes=_env_int("REFDCP_MAX_METADATA_BYTES", d.max_file_bytes),
            max_string_chars=_env_int("REFDCP_MAX_METADATA_STRING", d.max_string_chars),
        )


_current: MetadataLimits | None = None


def get_metadata_limits() -> MetadataLimits:
    """The limits in force: those set by ``set_metadata_limits``, else from the environment."""
    return _current if _current is not None else MetadataLimits.from_env()


def set_metadata_limits(limits: MetadataLimits | None = None, **changes: int) -> MetadataLimits:
    """Set the process-wide limits (``None`` and no changes: back to the defaults/environment).

    ``set_metadata_limits(max_file_bytes=4 << 30)`` changes one cap and keeps the others.
    Returns the previous limits so a caller can restore them.
    """
    global _current
    previous = get_metadata_limits()
    if limits is None and not changes:
        _current = None
        return previous
    base = limits if limits is not None else previous
    new = dataclasses.replace(base, **changes)
    for f in dataclasses.fields(new):
        if getattr(new, f.name) <= 0:
            raise ValueError(f"{f.name} must be positive, got {getattr(new, f.name)}")
    _current = new
    return previous
