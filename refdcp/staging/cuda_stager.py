"""CUDA async stager: device-to-host copies on a side stream (STAGE-14, STAGE-15).

``stage`` enqueues the copies into pinned, cached buffers on a dedicated CUDA
stream and returns a ``Future`` at once, so the copy overlaps the next
forward/backward. The future resolves (and ``synchronize_staging`` returns)
once the copy event has completed; only then may the source be mutated.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from refdcp.staging.buffer_pool import BufferPool
from refdcp.staging.cpu_stager import CpuStager, StagedStateDict
from refdcp.staging.tree import build_snapshot, layout_of

__all__ = ["CudaAsyncStager"]


class CudaAsyncStager(CpuStager):
    """Stage CUDA tensors into pinned host buffers on a side stream (STAGE-14).

    ``should_synchronize_after_execute`` is False: the caller decides when to
    wait (``synchronize_staging()`` or ``handle.staged``), e.g. just before the
    optimizer step mutates the parameters.
    """

    _synchronize_after_execute: bool = False

    def __init__(
        self,
        *,
        type_check: bool = False,
        max_buffer_sets: int = 2,
        max_bytes: int | None = None,
        wait_timeout: float = 600.0,
        device: torch.device | int | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaAsyncStager needs CUDA; use CpuStager on a CPU-only machine")
        super().__init__(
            cache_staged_state_dict=True,
            type_check=type_check,
            pin_memory=True,
            max_buffer_sets=max_buffer_sets,
            max_bytes=max_bytes,
            wait_timeout=wait_timeout,
        )
        if device is None:
            device = torch.cuda.current_device()
        self.device = device if isinstance(device, torch.device) else torch.device("cuda", device)
        self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refdcp-cuda-stage")
        self._last: Future[dict[str, Any]] | None = None
        self._stage_lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """Enqueue the copies and return a Future of the snapshot (STAGE-14)."""
        layout = layout_of(state_dict, type_check=self.type_check)
        pool: BufferPool | None = self.pool
        assert pool is not None
        lease = pool.acquire(layout)
        try:
            producer = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(producer)  # the copies see every queued write
            sources: list[torch.Tensor] = []

            def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
                src = src.detach()
                if src.is_cuda:
                    src.record_stream(self.stream)  # keep the allocator from reusing it
                    sources.append(src)
                    dst.copy_(src, non_blocking=True)
                else:
                    dst.copy_(src)

            with torch.cuda.stream(self.stream):
                out = build_snapshot(state_dict, layout, lease.buffers, copy_async)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(self.stream)
        except BaseException:
            pool.copy_failed(lease)
            raise

        def wait() -> dict[str, Any]:
            try:
                done.synchronize()
            except BaseException:
                pool.copy_failed(lease)
                raise
            pool.copy_done(lease)
            staged = StagedStateDict(out)
            self._track(staged, lease)
            return staged

        with self._stage_lock:
            fut = self._executor.submit(wait)
            self._last = fut
        return fut

    def synchronize_staging(self) -> None:
        """Block until the most recent ``stage`` has completed its copies (STAGE-15)."""
        with self._stage_lock:
            fut = self._last
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Wait for pending copies, stop the helper thread and free the buffers."""
        self.synchronize_staging()
        self._executor.shutdown(wait=True)
        super().close()
