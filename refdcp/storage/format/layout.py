"""File names of a filesystem checkpoint (FMT-1, FMT-2, STORE-2), and the rule for data-file
names read from ``.metadata`` (STORE-26): plain names only; ``storage/fs/paths.py`` opens them."""

from __future__ import annotations

import dataclasses
import re
import uuid

from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan

from refdcp.storage.errors import UnsafePathError

__all__ = [
    "MAX_NAME_BYTES",
    "METADATA_NAME",
    "check_data_name",
    "SavePrefix",
    "MetadataStamp",
    "assign_rank_prefixes",
    "with_save_token",
    "plan_token",
    "plan_directory",
    "plan_prefix",
    "rank_of_file",
    "rank_of_metadata",
    "data_file_name",
    "is_data_file",
    "is_metadata_temp",
    "metadata_temp_name",
    "new_save_token",
    "rank_metadata_name",
]

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
_TEMP = re.compile(r"^(__\d+)?\.metadata\.([0-9a-f]+\.)?tmp$")
_RANK_PREFIX = re.compile(r"^__(\d+)_")
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")


def new_save_token() -> str:
    """A short random token that makes one save's data file names unique (STORE-2)."""
    return uuid.uuid4().hex[:12]


def data_file_name(prefix: str, n: int, token: str) -> str:
    """``__{rank}_{n}.{token}.distcp``: unique to one save, so never mistaken for committed data."""
    return f"{prefix}{n}.{token}{DATA_SUFFIX}"


def rank_metadata_name(rank: int | None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` for rank-local (no-collectives) saves."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def metadata_temp_name(rank: int | None, token: str) -> str:
    """The temporary name ``.metadata`` is written under before its atomic rename."""
    return f"{rank_metadata_name(rank)}.{token}.tmp"


def rank_of_file(name: str) -> int | None:
    """The rank in a data file's ``__{rank}_`` prefix, or None."""
    m = _RANK_PREFIX.match(name)
    return int(m.group(1)) if m else None


def rank_of_metadata(name: str) -> int | None:
    """The rank of a rank-local ``__{rank}.metadata`` file, or None for any other name."""
    m = _RANK_METADATA.match(name)
    return int(m.group(1)) if m else None


def is_data_file(name: str) -> bool:
    return name.startswith("__") and name.endswith(DATA_SUFFIX)


def is_metadata_temp(name: str) -> bool:
    return _TEMP.match(name) is not None


def assign_rank_prefixes(plans: list[SavePlan]) -> list[SavePlan]:
    """Give plan ``i`` torch's file prefix ``__{i}_`` unless it already has one (STORE-9)."""
    return [
        dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
        if p.storage_data is None
        else p
        for i, p in enumerate(plans)
    ]


def plan_prefix(plan: SavePlan) -> str:
    """The file prefix the global plan gave this rank (``__0_`` for a lone writer)."""
    data = plan.storage_data
    return data.prefix if isinstance(data, _StoragePrefix) else "__0_"


@dataclasses.dataclass
class SavePrefix(_StoragePrefix):
    """torch's file prefix plus the coordinator's save token, so every rank's files
    carry one token per save (STORE-30)."""

    token: str = ""
    #: the coordinator's opened directory: (device, inode, host and boot) (STORE-57)
    directory: tuple[int, int, str] | None = None


def with_save_token(
    plans: list[SavePlan], token: str, directory: tuple[int, int, str] | None = None
) -> list[SavePlan]:
    """Tag every plan's prefix with the save token and the coordinator's directory
    (keeps torch's ``_StoragePrefix`` API)."""
    return [
        dataclasses.replace(p, storage_data=SavePrefix(plan_prefix(p), token, directory))
        for p in plans
    ]


@dataclasses.dataclass(frozen=True)
class MetadataStamp:
    """What a rank's load plan carries to the coordinator: the size and CRC-32C of the
    ``.metadata`` this rank read, so ranks that read different commits are found
    before anything is read (LOAD-23)."""

    size: int
    crc: int


def plan_directory(plan: SavePlan) -> tuple[int, int, str] | None:
    """The directory the coordinator opened for this save, if the plan says (STORE-57)."""
    data = plan.storage_data
    return data.directory if isinstance(data, SavePrefix) else None


def plan_token(plan: SavePlan) -> str | None:
    """The save token the coordinator gave this plan, if any."""
    data = plan.storage_data
    return data.token if isinstance(data, SavePrefix) and data.token else None


MAX_NAME_BYTES = 255


def check_data_name(name: object, *, file: str = METADATA_NAME, fqn: str | None = None) -> str:
    """``name`` if it is a plain file name, else raise ``UnsafePathError`` (STORE-26)."""
    who = f" (item {fqn!r})" if fqn is not None else ""
    if not isinstance(name, str):
        raise UnsafePathError(
            f"{file}: data-file name{who} is a {type(name).__name__}, not a str; refusing it"
        )
    bad = (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
    )
    if bad:
        raise UnsafePathError(
            f"{file}: data-file name {name[:200]!r}{who} is not a plain file name inside the "
            "checkpoint directory (separators, '..', absolute paths and empty names are refused)"
        )
    return name
