"""Offline verification of a checkpoint's checksums (INTEG-6, INTEG-7)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from refdcp.storage import layout
from refdcp.storage.errors import (
    CorruptionError,
    FormatVersionError,
    MissingChecksumError,
    UnsafeMetadataError,
)
from refdcp.storage.items import verify_blob
from refdcp.storage.safe_metadata import load_metadata

__all__ = ["Problem", "VerifyReport", "verify_checkpoint", "verify_files"]


@dataclass(frozen=True)
class Problem:
    """One defect: which item (None: the metadata), which file, which byte offset."""

    fqn: str | None
    file: str
    offset: int
    message: str


@dataclass
class VerifyReport:
    """Outcome of ``verify_checkpoint``; ``ok`` is True only with no problems."""

    path: str
    items_checked: int = 0
    items_without_checksum: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "items_checked": self.items_checked,
            "items_without_checksum": self.items_without_checksum,
            "problems": [p.__dict__ for p in self.problems],
        }


def verify_files(
    metadata_bytes: bytes | None, read_file: Callable[[str], bytes | None], path: str
) -> VerifyReport:
    """Verify a checkpoint given its metadata bytes and a file reader (INTEG-6)."""
    report = VerifyReport(path)
    if metadata_bytes is None:
        report.problems.append(
            Problem(None, layout.METADATA_NAME, 0, "no .metadata: not committed")
        )
        return report
    try:
        metadata = load_metadata(metadata_bytes, file=layout.METADATA_NAME)
    except CorruptionError as exc:
        report.problems.append(Problem(None, exc.file, exc.offset, str(exc)))
        return report
    except (UnsafeMetadataError, FormatVersionError) as exc:
        report.problems.append(Problem(None, layout.METADATA_NAME, 0, str(exc)))
        return report
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    located = {(k.fqn, tuple(k.offset) if k.offset is not None else None) for k in storage}
    located_fqns = {k.fqn for k in storage}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            missing = any((fqn, tuple(c.offsets)) not in located for c in md.chunks)
        else:
            missing = fqn not in located_fqns
        if missing:
            report.problems.append(Problem(fqn, layout.METADATA_NAME, 0, "no storage location"))
    cache: dict[str, bytes | None] = {}
    for index, info in storage.items():
        name = info.relative_path
        if name not in cache:
            cache = {name: read_file(name)}
        data = cache[name]
        if data is None:
            report.problems.append(Problem(index.fqn, name, info.offset, "data file missing"))
            continue
        blob = memoryview(data)[info.offset : info.offset + info.length]
        try:
            verify_blob(blob, info, index.fqn, name)
            report.items_checked += 1
        except MissingChecksumError:
            report.items_without_checksum += 1
        except CorruptionError as exc:
            report.problems.append(Problem(index.fqn, name, exc.offset, str(exc)))
    return report


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Verify every checksum of the filesystem checkpoint at ``path`` (INTEG-6)."""
    root = Path(path)

    def read(name: str) -> bytes | None:
        try:
            return (root / name).read_bytes()
        except OSError:
            return None

    return verify_files(read(layout.METADATA_NAME), read, str(root))
