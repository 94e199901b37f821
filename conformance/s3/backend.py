"""Backend for ``s3torchconnector.dcp`` S3StorageWriter/S3StorageReader (CONF-43).

Used by ``conformance/s3/run.sh`` against a SeaweedFS S3 gateway on 127.0.0.1;
the endpoint, bucket and region come from the environment
(``AWS_ENDPOINT_URL``, ``REFDCP_S3_BUCKET``, ``AWS_REGION``).
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

__all__ = ["S3Backend", "backend"]


@dataclass
class S3Backend:
    """Each location is a fresh prefix ``s3://{bucket}/{run id}/ckpt-{n}``."""

    name: str = "s3torchconnector 1.5.0 S3StorageWriter/S3StorageReader"
    capabilities: Capabilities = field(default_factory=Capabilities)
    bucket: str = field(default_factory=lambda: os.environ.get("REFDCP_S3_BUCKET", "refdcp"))
    region: str = field(default_factory=lambda: os.environ.get("AWS_REGION", "us-east-1"))
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _n: Any = field(default_factory=itertools.count)

    def _dcp(self) -> Any:
        return importlib.import_module("s3torchconnector.dcp")

    def new_location(self, scratch: Path) -> Any:
        return f"s3://{self.bucket}/{self.run}/ckpt-{next(self._n)}"

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        w: StorageWriter = self._dcp().S3StorageWriter(self.region, location)
        return w

    def reader(self, location: Any) -> StorageReader:
        r: StorageReader = self._dcp().S3StorageReader(self.region, location)
        return r


def backend() -> S3Backend:
    return S3Backend()
