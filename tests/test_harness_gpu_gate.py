"""make test-gpu cannot pass vacuously (HARN-14, HARN-15); the NCCL round-trip rank
function checked on Gloo/CPU (HARN-18), so it is right where no GPU is lent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from refdcp.testing import gpu_gate
from refdcp.testing.spawn import run_gloo
from tests.test_gpu_properties import nccl_round_trip

ROOT = Path(__file__).resolve().parents[1]


def _recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n?)+)", text, re.M)
    assert m, f"no {target} target in the Makefile"
    return m.group(1)


def _pytest_gpu(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != gpu_gate.ALLOW_ENV}
    env.update(env_extra, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))  # no usable CUDA
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "refdcp.testing.gpu_gate",
        "-m",
        "gpu",
        "-q",
        "-rs",
    ]
    cmd += ["-p", "no:randomly", "tests/test_staging_gpu.py"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.spec("HARN-14")
def test_make_test_gpu_loads_the_gate_and_make_test_does_not() -> None:
    assert "-p refdcp.testing.gpu_gate" in _recipe("test-gpu")
    assert "-m gpu" in _recipe("test-gpu")
    assert "gpu_gate" not in _recipe("test") and "not gpu" in _recipe("test")


@pytest.mark.spec("HARN-14")
def test_gpu_run_without_cuda_fails_with_a_clear_message() -> None:
    fail = _pytest_gpu({})  # end to end: the plugin stops the session before collection
    out = fail.stdout + fail.stderr
    assert fail.returncode == 4, out  # pytest's usage-error exit
    assert "CUDA is not usable" in out and gpu_gate.ALLOW_ENV in out


class _PluginManager:
    def __init__(self) -> None:
        self.registered: list[object] = []

    def register(self, plugin: object, name: str) -> None:
        self.registered.append(plugin)


class _Config:
    def __init__(self) -> None:
        self.pluginmanager = _PluginManager()


@pytest.mark.spec("HARN-14")
def test_allowing_no_gpu_lets_the_run_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_gate, "cuda_problem", lambda: "no driver")
    monkeypatch.delenv(gpu_gate.ALLOW_ENV, raising=False)
    with pytest.raises(pytest.UsageError, match="no driver"):
        gpu_gate.pytest_configure(_Config())  # type: ignore[arg-type]
    monkeypatch.setenv(gpu_gate.ALLOW_ENV, "1")
    cfg = _Config()
    gpu_gate.pytest_configure(cfg)  # type: ignore[arg-type]
    assert cfg.pluginmanager.registered == []  # no gate: the GPU tests skip with their reason
    monkeypatch.setattr(gpu_gate, "cuda_problem", lambda: None)
    gpu_gate.pytest_configure(cfg)  # type: ignore[arg-type]
    assert len(cfg.pluginmanager.registered) == 1  # with CUDA the skip/collection gate is on


class _Report:
    def __init__(self, nodeid: str, reason: str) -> None:
        self.nodeid, self.skipped = nodeid, True
        self.longrepr = ("file.py", 1, f"Skipped: {reason}")


class _Session:
    def __init__(self, items: list[Any]) -> None:
        self.items, self.exitstatus = items, pytest.ExitCode.OK


@pytest.mark.spec("HARN-15")
def test_gate_fails_on_skips_other_than_needing_more_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_gate.ALLOW_ENV, raising=False)
    assert gpu_gate.allowed_skip("multi-rank NCCL needs at least 2 GPUs (one rank per GPU)")
    assert gpu_gate.allowed_skip("needs more GPUs")
    assert not gpu_gate.allowed_skip("needs CUDA (no GPU on this machine)")
    gate = gpu_gate._Gate()
    gate.pytest_runtest_logreport(_Report("t.py::a", "needs at least 4 GPUs"))  # type: ignore[arg-type]
    s = _Session([object()])
    gate.pytest_sessionfinish(s, 0)  # type: ignore[arg-type]
    assert s.exitstatus == pytest.ExitCode.OK
    gate.pytest_runtest_logreport(_Report("t.py::b", "CUDA is broken"))  # type: ignore[arg-type]
    gate.pytest_sessionfinish(s, 0)  # type: ignore[arg-type]
    assert s.exitstatus == pytest.ExitCode.TESTS_FAILED and gate.bad_skips == [
        "t.py::b: Skipped: CUDA is broken"
    ]
    with pytest.raises(pytest.UsageError, match="no GPU test was collected"):
        gate.pytest_collection_finish(_Session([]))  # type: ignore[arg-type]


@pytest.mark.spec("HARN-14")
def test_cuda_problem_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problem = gpu_gate.cuda_problem()
    assert problem is not None and ("is_available" in problem or "no CUDA support" in problem)


@pytest.mark.dist
@pytest.mark.spec("HARN-18")
def test_round_trip_rank_function_on_gloo(tmp_path: Path) -> None:
    """The exact rank function the NCCL tests run, on CPU tensors over Gloo."""
    full = run_gloo(2, nccl_round_trip, str(tmp_path / "full"), False, "cpu", timeout=240.0)
    assert all(
        r == {"member": True, "x_ok": True, "x_device": "cpu", "rep_ok": True, "step": 5}
        for r in full
    )
    sub = run_gloo(4, nccl_round_trip, str(tmp_path / "sub"), True, "cpu", timeout=240.0)
    assert (
        sub[:2]
        == [{"member": True, "x_ok": True, "x_device": "cpu", "rep_ok": True, "step": 7}] * 2
    )
    assert sub[2:] == [{"member": False}] * 2


@pytest.mark.spec("HARN-19")
def test_d2h_bandwidth_is_a_benchmark_not_a_test(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from benchmarks import bench_gpu_staging
    from benchmarks.run import SUITES

    assert SUITES["gpu"] == "benchmarks.bench_gpu_staging"
    doc = bench_gpu_staging.__doc__ or ""
    assert "raw pinned copy" in doc and "CudaAsyncStager" in doc and "CpuStager" in doc
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench_gpu_staging.main([])  # without CUDA it says so and measures nothing
    assert "GPU staging benchmark skipped" in capsys.readouterr().out
    gpu_tests = (ROOT / "tests" / "test_gpu_properties.py").read_text(encoding="utf-8")
    assert "perf_counter" not in gpu_tests and "monotonic" not in gpu_tests  # no timing in tests
