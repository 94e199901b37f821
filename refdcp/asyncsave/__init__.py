"""Asynchronous saves: stage now, write on an executor (spec/staging.md, ASYNC-*).

Layering: this package sits above :mod:`refdcp.staging` (snapshots into leased
buffers) and :mod:`refdcp.api` (the synchronous save it runs in the
background); nothing below imports it.
"""

from refdcp.asyncsave.checkpointer import Checkpointer
from refdcp.asyncsave.default_stager import release_staging_buffers
from refdcp.asyncsave.save import AsyncSaveHandle, InFlightLimiter, async_save

__all__ = [
    "AsyncSaveHandle",
    "Checkpointer",
    "InFlightLimiter",
    "async_save",
    "release_staging_buffers",
]
