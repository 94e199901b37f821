"""Removing what failed saves wrote, and reclaiming their orphans (STORE-31..STORE-33).

Every file a refdcp save writes carries its save token in its name
(``__{rank}_{n}.{token}.distcp``, ``.metadata.{token}.tmp``). A file is
removed only when it is provably not part of a committed checkpoint (no
committed ``.metadata`` of the directory references it) and not part of a
live save (its token is not the token of a held save lock, ``lock.py``).
When either cannot be established (an unreadable ``.metadata``, a lock whose
holder cannot be told), nothing is removed: the rule errs on keeping files.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from refdcp.storage.format import layout
from refdcp.storage.fs.lock import live_lock_tokens
from refdcp.storage.fs.paths import at

__all__ = [
    "abort_writer",
    "committed_references",
    "reclaim_orphans",
    "remove_files",
    "token_of",
]

_DATA = re.compile(r"^__(\d+)_\d+\.([0-9a-f]{12})\.distcp$")
_TEMP = re.compile(r"^(?:__\d+)?\.metadata\.([0-9a-f]+)\.tmp$")
_METADATA = re.compile(r"^(?:__\d+)?\.metadata$")


def token_of(name: str) -> str | None:
    """The save token in a refdcp data or metadata-temp file name, else None."""
    m = _DATA.match(name)
    if m:
        return m.group(2)
    m = _TEMP.match(name)
    return m.group(1) if m else None


def committed_references(
    root: Path, names: Iterable[str] | None = None, *, dir_fd: int | None = None
) -> set[str] | None:
    """Every data-file name referenced by a committed metadata file of ``root`` (or of
    the opened directory ``dir_fd``, STORE-57).

    None when a metadata file exists but cannot be read or parsed: then no
    reference can be ruled out and callers must not remove data files.
    """
    from refdcp.storage.fs.metadata_file import read_metadata_file
    from refdcp.storage.metadata.safe import load_metadata

    if names is None:
        try:
            names = os.listdir(root if dir_fd is None else dir_fd)
        except OSError:
            return None
    refs: set[str] = set()
    for name in names:
        if not _METADATA.match(name):
            continue
        try:
            data = read_metadata_file(at(root, name, dir_fd), dir_fd=dir_fd)
            md = load_metadata(data, file=str(root / name))
        except FileNotFoundError:
            continue
        except Exception:
            return None
        storage = md.storage_data if isinstance(md.storage_data, dict) else {}
        refs.update(getattr(info, "relative_path", "") for info in storage.values())
    return refs


def remove_files(root: Path, names: Iterable[str], *, dir_fd: int | None = None) -> list[str]:
    """Best-effort unlink (in the opened directory ``dir_fd`` when given); returns the
    names removed (a failure is a warning)."""
    removed = []
    for name in names:
        try:
            os.unlink(at(root, name, dir_fd), dir_fd=dir_fd)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"refdcp: could not remove {root / name}: {exc}", stacklevel=2)
    return removed


def reclaim_orphans(
    root: Path,
    *,
    own_token: str,
    rank_prefix: str | None = None,
    referenced: set[str] | None = None,
    committed_name: str | None = None,
    foreign_data: bool = False,
    dir_fd: int | None = None,
) -> list[str]:
    """Remove files of earlier failed or killed saves (STORE-32). Call holding the save lock.

    Candidates are refdcp files whose token is neither ``own_token`` nor held
    by a live lock. Metadata temp files are removed outright (a temp is never
    committed data). Data files are removed when no committed metadata
    references them: ``referenced`` when the caller knows it (the metadata it
    just committed), else parsed from the directory; parsing is skipped, and
    nothing removed, when a committed metadata exists and every candidate
    shares one token (that is almost surely the committed save's). With
    ``rank_prefix`` only that rank's files are considered (rank-local saves).
    ``foreign_data=True`` also removes unreferenced data files of torch's
    naming (``__{r}_{n}.distcp``), as STORE-5 asks after a commit.
    ``referenced`` holds the references of the metadata file ``committed_name``
    only: those of every other committed metadata file of the directory (global
    and rank-local) are added, and no data file is removed when one of them
    cannot be read (STORE-33). With ``dir_fd``, everything happens in that opened
    directory, whatever ``root`` names now (STORE-57).
    """
    try:
        names = os.listdir(root if dir_fd is None else dir_fd)
    except OSError:
        return []
    live = live_lock_tokens(root, dir_fd=dir_fd)
    if live is None:
        return []
    live.add(own_token)

    metadata_name = layout.METADATA_NAME
    if rank_prefix is not None:
        metadata_name = layout.rank_metadata_name(int(rank_prefix[2:-1]))

    def mine(name: str) -> bool:
        return rank_prefix is None or name.startswith(rank_prefix)

    temps = [
        n
        for n in names
        if _TEMP.match(n) and n.startswith(metadata_name + ".") and token_of(n) not in live
    ]
    data = [n for n in names if _DATA.match(n) and token_of(n) not in live and mine(n)]
    if foreign_data:
        data += [n for n in names if layout.is_data_file(n) and token_of(n) is None and mine(n)]
    if data and referenced is None:
        has_metadata = any(_METADATA.match(n) for n in names)
        if has_metadata and len({token_of(n) for n in data}) < 2:
            data = []
        elif has_metadata:
            referenced = committed_references(root, names, dir_fd=dir_fd)
            if referenced is None:
                data = []
    elif data:
        others = [n for n in names if _METADATA.match(n) and n != committed_name]
        extra = committed_references(root, others, dir_fd=dir_fd) if others else set()
        if extra is None:
            data = []
        else:
            referenced = (referenced or set()) | extra
    refs = referenced or set()
    return remove_files(root, temps + [n for n in data if n not in refs], dir_fd=dir_fd)


def wait_until_not_live(
    root: Path, token: str, timeout: float, *, dir_fd: int | None = None
) -> bool:
    """True once no live lock in ``root`` has ``token`` (False after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        live = live_lock_tokens(root, dir_fd=dir_fd)
        if live is not None and token not in live:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def abort_writer(writer: Any) -> None:
    """After a failed save: let the writer remove what it wrote (STORE-31). Never raises."""
    abort = getattr(writer, "abort_save", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as exc:  # best effort: the save's own error is what the caller sees
        warnings.warn(f"refdcp: cleaning up after a failed save failed: {exc}", stacklevel=2)
