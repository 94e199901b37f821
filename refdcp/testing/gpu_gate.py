"""pytest plugin behind ``make test-gpu``: a GPU run that tests nothing fails (HARN-14, HARN-15).

Loaded with ``-p refdcp.testing.gpu_gate``. Without usable CUDA (not built in,
no device, or a tiny kernel fails) the session stops with a usage error naming
the reason, unless ``REFDCP_ALLOW_NO_GPU=1``. With CUDA it fails the session
when no GPU test was collected or when a GPU test was skipped for any reason
other than needing more GPUs than the machine has. ``make test`` does not load
it, so there GPU tests keep skipping with their reason.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

__all__ = ["ALLOW_ENV", "cuda_problem", "allowed_skip"]

ALLOW_ENV = "REFDCP_ALLOW_NO_GPU"
#: the only skip reason a GPU test may give on a machine with usable CUDA
MORE_GPUS = "needs more GPUs"
_MORE_GPUS = re.compile(r"needs (more GPUs|at least \d+ GPUs)")


def cuda_problem() -> str | None:
    """Why CUDA cannot run the GPU tests here, or None when a kernel ran correctly."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        return f"torch does not import: {e}"
    if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no driver or no visible device)"
    try:
        x = torch.arange(4, device="cuda", dtype=torch.float32)
        ok = float((x * 2).sum().item()) == 12.0
    except Exception as e:  # a broken runtime raises here
        return f"a CUDA kernel failed: {type(e).__name__}: {e}"
    return None if ok else "a CUDA kernel returned a wrong result"


def allowed_skip(reason: str) -> bool:
    """A GPU test may skip on a CUDA machine only because it needs more GPUs (HARN-15)."""
    return _MORE_GPUS.search(reason) is not None


def _allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "") == "1"


class _Gate:
    def __init__(self) -> None:
        self.bad_skips: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.items and not _allowed():
            raise pytest.UsageError(
                "make test-gpu: no GPU test was collected; a GPU run that tests nothing fails "
                f"(set {ALLOW_ENV}=1 to allow it)"
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not _allowed():
            reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
            if not allowed_skip(reason):
                self.bad_skips.append(f"{report.nodeid}: {reason}")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.bad_skips:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.bad_skips:
            terminalreporter.write_line(
                f"make test-gpu FAILED: {len(self.bad_skips)} GPU test(s) skipped on a CUDA "
                f"machine (only 'needs more GPUs' / 'needs at least N GPUs' skips are allowed):",
                red=True,
            )
            for line in self.bad_skips:
                terminalreporter.write_line(f"  {line}")


def pytest_configure(config: pytest.Config) -> None:
    problem = cuda_problem()
    if problem is not None and not _allowed():
        raise pytest.UsageError(
            f"make test-gpu: CUDA is not usable on this machine: {problem}. The GPU tests "
            f"would only skip, so this run fails; set {ALLOW_ENV}=1 to run them anyway "
            "(they then skip), or use make test for the CPU suite."
        )
    if problem is None:
        config.pluginmanager.register(_Gate(), "refdcp-gpu-gate")
