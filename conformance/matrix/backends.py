"""Real third-party DCP storage backends, each in the configuration that works (CONF-56).

The servers are local (``conformance/matrix/run.py`` starts them on 127.0.0.1)
and reach these backends through the environment:

* ``REFDCP_S3_ENDPOINT``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_REGION``, ``REFDCP_S3_BUCKET``: the S3 server (SeaweedFS);
* ``REFDCP_AZURE_CONNECTION_STRING``, ``REFDCP_AZURE_CONTAINER``: Azurite;
* ``MSC_CONFIG``: multi-storage-client's profiles ``local`` (POSIX) and ``s3``.

torch 2.13's ``FsspecWriter``/``FsspecReader`` rebuild their filesystem in
``reset(checkpoint_id)`` from the URL alone and drop the options given to the
constructor (endpoint, credentials). The working configuration therefore also
puts the options into ``fsspec.config.conf[protocol]``, which ``url_to_fs``
applies on every rebuild; the ``*_constructor_options`` variants pass them to
the constructor only, as torch's documentation shows, to record what then
happens after a reset.
"""

from __future__ import annotations

import importlib
import itertools
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from conformance.backend import Capabilities

__all__ = [
    "FsspecBackend",
    "HuggingFaceBackend",
    "MscBackend",
    "fsspec_azure",
    "fsspec_azure_constructor_options",
    "fsspec_s3",
    "fsspec_s3_constructor_options",
    "huggingface",
    "msc_posix",
    "msc_s3",
]


def s3_options() -> dict[str, Any]:
    """s3fs options for the local S3 server (path-style addressing, fixed region)."""
    return {
        "endpoint_url": os.environ["REFDCP_S3_ENDPOINT"],
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": os.environ.get("AWS_REGION", "us-east-1")},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


def azure_options() -> dict[str, Any]:
    """adlfs options for Azurite: its development account's connection string."""
    return {"connection_string": os.environ["REFDCP_AZURE_CONNECTION_STRING"]}


@dataclass
class FsspecBackend:
    """torch's ``FsspecWriter``/``FsspecReader`` over an fsspec protocol with options."""

    protocol: str
    root: str
    options: dict[str, Any]
    name: str
    survive_reset: bool = True
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(thread_count=True))
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _n: Any = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.survive_reset:
            import fsspec.config

            # The working configuration: url_to_fs applies these on every rebuild.
            fsspec.config.conf[self.protocol] = dict(self.options)

    def new_location(self, scratch: Path) -> Any:
        return f"{self.protocol}://{self.root}/{self.run}/ckpt-{next(self._n)}"

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(location, sync_files=False, thread_count=thread_count, **self.options)

    def reader(self, location: Any) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(location, **self.options)


def fsspec_s3() -> FsspecBackend:
    return FsspecBackend(
        "s3",
        os.environ.get("REFDCP_S3_BUCKET", "refdcp"),
        s3_options(),
        "torch FsspecWriter/FsspecReader + s3fs (SeaweedFS S3)",
    )


def fsspec_s3_constructor_options() -> FsspecBackend:
    return FsspecBackend(
        "s3",
        os.environ.get("REFDCP_S3_BUCKET", "refdcp"),
        s3_options(),
        "torch FsspecWriter/FsspecReader + s3fs, options to the constructor only",
        survive_reset=False,
    )


def fsspec_azure() -> FsspecBackend:
    return FsspecBackend(
        "abfs",
        os.environ.get("REFDCP_AZURE_CONTAINER", "refdcp"),
        azure_options(),
        "torch FsspecWriter/FsspecReader + adlfs (Azurite)",
    )


def fsspec_azure_constructor_options() -> FsspecBackend:
    return FsspecBackend(
        "abfs",
        os.environ.get("REFDCP_AZURE_CONTAINER", "refdcp"),
        azure_options(),
        "torch FsspecWriter/FsspecReader + adlfs, options to the constructor only",
        survive_reset=False,
    )


@dataclass
class MscBackend:
    """multi-storage-client's ``MultiStorageFileSystemWriter``/``Reader`` on a profile of
    ``MSC_CONFIG`` (the profile, not the path, holds endpoint and credentials)."""

    profile: str
    name: str
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(thread_count=True))
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _n: Any = field(default_factory=itertools.count)

    def new_location(self, scratch: Path) -> Any:
        return f"msc://{self.profile}/{self.run}/ckpt-{next(self._n)}"

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        msc = importlib.import_module("multistorageclient.contrib.torch")
        w: StorageWriter = msc.MultiStorageFileSystemWriter(
            location, sync_files=False, thread_count=thread_count
        )
        return w

    def reader(self, location: Any) -> StorageReader:
        msc = importlib.import_module("multistorageclient.contrib.torch")
        r: StorageReader = msc.MultiStorageFileSystemReader(location)
        return r


def msc_posix() -> MscBackend:
    return MscBackend("local", "multi-storage-client, POSIX profile")


def msc_s3() -> MscBackend:
    return MscBackend("s3", "multi-storage-client, S3 profile (SeaweedFS)")


@dataclass
class HuggingFaceBackend:
    """torch's ``HuggingFaceStorageWriter``/``Reader`` on a local directory (safetensors files).

    Its default mode is rank-0 checkpointing of a full state dict, and safetensors
    holds tensors only: it declares neither ``shared_location`` nor ``bytes_items``.
    """

    name: str = "torch HuggingFaceStorageWriter/HuggingFaceStorageReader (local path)"
    capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(
            thread_count=True, shared_location=False, bytes_items=False
        )
    )

    def new_location(self, scratch: Path) -> Any:
        return str(scratch / "ckpt")

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        return HuggingFaceStorageWriter(location, thread_count=thread_count)

    def reader(self, location: Any) -> StorageReader:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

        return HuggingFaceStorageReader(location)


def huggingface() -> HuggingFaceBackend:
    return HuggingFaceBackend()
