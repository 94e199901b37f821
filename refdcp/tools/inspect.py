"""``refdcp inspect PATH [--json]``: what a DCP checkpoint directory holds (spec/tooling.md, TOOL-*).

Works on checkpoints written by torch's ``FileSystemWriter`` and by refdcp.
``.metadata`` is read with refdcp's restricted reader
(``refdcp.storage.metadata.safe``), so inspecting a crafted checkpoint never
runs code from it (TOOL-7).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from refdcp.errors import MetadataLoadError
from refdcp.storage.format import layout
from refdcp.storage.metadata.safe import FORMAT_ATTR, has_checksum_trailer

__all__ = ["MetadataLoadError", "inspect_checkpoint", "inspect_command", "load_metadata_safely"]

METADATA_FILE = layout.METADATA_NAME
_CHECKSUM_WORDS = ("checksum", "crc", "digest", "sha256", "hash")


def load_metadata_safely(path: str | os.PathLike[str]) -> Metadata:
    """Unpickle a metadata file without executing code from it (TOOL-7)."""
    return _load_metadata_bytes(path)[0]


def _load_metadata_bytes(path: str | os.PathLike[str]) -> tuple[Metadata, bytes]:
    """The metadata and its bytes; any failure is a one-line ``MetadataLoadError`` (TOOL-12)."""
    from refdcp.storage.fs.metadata_file import read_metadata_file
    from refdcp.storage.metadata.safe import load_metadata

    try:
        data = read_metadata_file(path)
    except OSError as exc:
        raise MetadataLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    except Exception as exc:
        raise MetadataLoadError(f"{path}: cannot be read: {exc}") from exc
    try:
        return load_metadata(data, file=str(path), filesystem=False), data
    except Exception as exc:
        raise MetadataLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def one_line(text: str) -> str:
    """``text`` with line breaks folded, for one-line CLI errors (TOOL-12)."""
    return " ".join(text.split())


def _rank_of(relative_path: str) -> int | None:
    return layout.rank_of_file(os.path.basename(relative_path))


def _fields_of(obj: object) -> dict[str, Any]:
    if isinstance(obj, dict):
        return {str(k): v for k, v in obj.items()}
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    # Extra attributes set on torch's records (refdcp's checksums live there).
    out.update(getattr(obj, "__dict__", {}))
    return out


def _find_checksums(obj: object, where: str, depth: int = 0) -> str | None:
    """First place (a dotted path) whose field name names a checksum (TOOL-6)."""
    if depth > 4 or isinstance(obj, (str, bytes, int, float, torch.Tensor)) or obj is None:
        return None
    for key, value in _fields_of(obj).items():
        if value is not None and any(w in key.lower() for w in _CHECKSUM_WORDS):
            return f"{where}.{key}"
        found = _find_checksums(value, f"{where}.{key}", depth + 1)
        if found:
            return found
    return None


def _checksum_location(md: Metadata, files: list[str]) -> str | None:
    extra = {k: v for k, v in vars(md).items() if k != "state_dict_metadata"}
    for key, value in extra.items():
        if key == "storage_data" and isinstance(value, dict):
            for sub in list(value.values())[:1]:
                found = _find_checksums(sub, "storage_data[*]")
                if found:
                    return found
            continue
        if value is not None and any(w in key.lower() for w in _CHECKSUM_WORDS):
            return key
        found = _find_checksums(value, key)
        if found:
            return found
    for name in files:
        if any(w in name.lower() for w in (*_CHECKSUM_WORDS, "manifest")):
            return f"file {name}"
    return None


def _storage_location(storage: object, key: MetadataIndex) -> dict[str, Any]:
    info = storage.get(key) if isinstance(storage, dict) else None
    if info is None:
        return {"file": None, "rank": None, "offset": None, "length": None}

    def field(name: str) -> Any:
        return info.get(name) if isinstance(info, dict) else getattr(info, name, None)

    rel = field("relative_path")
    return {
        "file": rel,
        "rank": _rank_of(rel) if isinstance(rel, str) else None,
        "offset": field("offset"),
        "length": field("length"),
    }


def _describe_keys(md: Metadata) -> list[dict[str, Any]]:
    storage = md.storage_data
    out: list[dict[str, Any]] = []
    for fqn in sorted(md.state_dict_metadata):
        entry = md.state_dict_metadata[fqn]
        if isinstance(entry, TensorStorageMetadata):
            chunks = []
            for c in sorted(entry.chunks, key=lambda c: tuple(c.offsets)):
                loc = _storage_location(storage, MetadataIndex(fqn, c.offsets))
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), **loc})
            out.append(
                {
                    "fqn": fqn,
                    "kind": "tensor",
                    "dtype": str(entry.properties.dtype).removeprefix("torch."),
                    "shape": list(entry.size),
                    "chunks": chunks,
                }
            )
        else:
            kind = "bytes" if isinstance(entry, BytesStorageMetadata) else type(entry).__name__
            loc = _storage_location(storage, MetadataIndex(fqn))
            out.append({"fqn": fqn, "kind": kind, "dtype": None, "shape": None, "chunks": [loc]})
    return out


def _describe_files(root: Path, referenced: set[str]) -> list[dict[str, Any]]:
    files = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.is_file():
            continue
        files.append(
            {
                "name": entry.name,
                "size": entry.stat().st_size,
                "rank": _rank_of(entry.name),
                "referenced": entry.name in referenced,
            }
        )
    return files


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``refdcp inspect`` reports, as JSON-ready data (TOOL-1..TOOL-6)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint directory")
    entries = list(os.scandir(root))
    names = sorted(e.name for e in entries if e.is_file())
    # present in any form counts: an unreadable .metadata is an error, not "uncommitted" (TOOL-13)
    committed = any(e.name == METADATA_FILE for e in entries)
    report: dict[str, Any] = {
        "path": str(path),
        "committed": committed,
        "format_version": None,
        "refdcp_format": None,
        "metadata_checksum": False,
        "checksums": "absent",
        "checksum_location": None,
        "storage_meta": None,
        "keys": [],
        "files": [],
        "ranks": {},
        "rank_local_metadata": sorted(n for n in names if layout.rank_of_metadata(n) is not None),
    }
    referenced: set[str] = {METADATA_FILE} if committed else set()
    if committed:
        md, data = _load_metadata_bytes(root / METADATA_FILE)
        report["format_version"] = md.version
        report["refdcp_format"] = getattr(md, FORMAT_ATTR, None)
        tail = data[-64:]
        report["metadata_checksum"] = has_checksum_trailer(tail)
        sm = md.storage_meta
        if sm is not None:
            report["storage_meta"] = {
                "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
                "save_id": sm.save_id,
                "modules": list(sm.modules),
            }
        where = _checksum_location(md, names)
        report["checksums"] = "present" if where else "absent"
        report["checksum_location"] = where
        report["keys"] = _describe_keys(md)
        for key in report["keys"]:
            referenced.update(c["file"] for c in key["chunks"] if c["file"])
    report["files"] = _describe_files(root, referenced)
    ranks: dict[str, dict[str, int]] = {}
    for key in report["keys"]:
        for c in key["chunks"]:
            if c["rank"] is None:
                continue
            r = ranks.setdefault(str(c["rank"]), {"items": 0, "bytes": 0, "files": 0})
            r["items"] += 1
            r["bytes"] += c["length"] or 0
    for f in report["files"]:
        if f["rank"] is not None and f["referenced"]:
            ranks.setdefault(str(f["rank"]), {"items": 0, "bytes": 0, "files": 0})["files"] += 1
    report["ranks"] = dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))
    return report


def _fmt_list(xs: list[int] | None) -> str:
    return "-" if xs is None else "[" + ",".join(map(str, xs)) + "]"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable text of ``refdcp inspect`` (TOOL-1)."""
    lines = [f"checkpoint: {report['path']}"]
    lines.append(
        "committed: "
        + ("yes (.metadata present)" if report["committed"] else "NO (.metadata absent)")
    )
    version = f"format version: {report['format_version'] or '-'}"
    if report["refdcp_format"] is not None:
        version += f" (refdcp format {report['refdcp_format']})"
    lines.append(version)
    where = report["checksum_location"]
    lines.append(f"checksums: {report['checksums']}" + (f" ({where})" if where else ""))
    if report["metadata_checksum"]:
        lines.append("metadata checksum: present (refdcp trailer)")
    if report["rank_local_metadata"]:
        lines.append("rank-local metadata: " + ", ".join(report["rank_local_metadata"]))
    keys = report["keys"]
    n_tensors = sum(1 for k in keys if k["kind"] == "tensor")
    lines.append(f"keys: {len(keys)} ({n_tensors} tensors, {len(keys) - n_tensors} other)")
    for k in keys:
        if k["kind"] == "tensor":
            lines.append(
                f"  {k['fqn']}  tensor {k['dtype']} {_fmt_list(k['shape'])}  "
                f"{len(k['chunks'])} chunk(s)"
            )
            for c in k["chunks"]:
                lines.append(
                    f"    offsets={_fmt_list(c['offsets'])} sizes={_fmt_list(c['sizes'])}  "
                    + _fmt_loc(c)
                )
        else:
            lines.append(f"  {k['fqn']}  {k['kind']}  " + _fmt_loc(k["chunks"][0]))
    files = report["files"]
    lines.append(f"files: {len(files)} ({sum(f['size'] for f in files)} bytes)")
    for f in files:
        tags = [] if f["rank"] is None else [f"rank {f['rank']}"]
        if report["committed"] and not f["referenced"]:
            tags.append("not referenced by .metadata")
        lines.append(f"  {f['name']}  {f['size']}" + (f"  ({', '.join(tags)})" if tags else ""))
    lines.append("ranks:")
    for rank, r in report["ranks"].items():
        lines.append(
            f"  rank {rank}: {r['items']} item(s), {r['bytes']} bytes, {r['files']} file(s)"
        )
    return "\n".join(lines) + "\n"


def _fmt_loc(c: dict[str, Any]) -> str:
    if c["file"] is None:
        return "(no storage record)"
    rank = "?" if c["rank"] is None else c["rank"]
    return f"rank {rank}  {c['file']} @{c['offset']} +{c['length']}"


def inspect_command(path: str, *, as_json: bool) -> int:
    """CLI entry: print the report; 0 when committed, 1 when not, 2 on error (TOOL-8, TOOL-12)."""
    try:
        report = inspect_checkpoint(path)
    except OSError as exc:
        where = exc.filename if exc.filename else path
        print(f"refdcp inspect: {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except MetadataLoadError as exc:
        print(f"refdcp inspect: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(format_report(report))
    return 0 if report["committed"] else 1
