"""``make test-gpu`` on a prepared image: the installed interpreter, no venv, offline (HARN-24).

Run here without CUDA, so each run ends at the GPU gate (pytest's usage error, 4) unless
``REFDCP_ALLOW_NO_GPU=1``; what is checked is which interpreter ran, what was installed from
the wheel folder and that nothing was fetched (``PIP_NO_INDEX=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from refdcp.testing import gpu_gate

ROOT = Path(__file__).resolve().parents[1]


def _make(tmp: Path, *args: str, allow: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (gpu_gate.ALLOW_ENV, "MAKEFLAGS")}
    env.update(CUDA_VISIBLE_DEVICES="", PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    if allow:
        env[gpu_gate.ALLOW_ENV] = "1"
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), "test-gpu", f"PY={sys.executable}"]
    cmd += [f"GPU_SITE={tmp / 'site'}", f"GPU_WHEELS={tmp / 'wheels'}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _tiny_wheel(folder: Path, module: str, dist: str) -> None:
    """A pure wheel holding one module, as pip expects one (no network needed to install it)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{dist.replace('-', '_')}-1.0.dist-info"
    files = {
        f"{module}.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{dist.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


@pytest.mark.spec("HARN-24")
def test_auto_mode_picks_the_installed_interpreter_when_there_is_no_venv(tmp_path: Path) -> None:
    # BIN points at no venv, and this interpreter imports torch, pytest, hypothesis and xdist
    out = subprocess.run(
        [*("make", "-n", "--no-print-directory", "-C", str(ROOT), "test-gpu"),
         f"PY={sys.executable}", f"BIN={tmp_path / 'absent' / 'bin'}"],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert f"interpreter {sys.executable} (VENV_MODE=auto)" in out, out
    assert f"{sys.executable} -m pytest -p refdcp.testing.gpu_gate -m gpu" in out, out
    venv = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), "test-gpu", "VENV_MODE=venv"],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert "interpreter .venv/bin/python (VENV_MODE=venv)" in venv, venv


@pytest.mark.spec("HARN-24", "HARN-14")
@pytest.mark.slow  # long; make test-thorough runs it
def test_system_mode_with_every_dependency_installs_nothing_and_reaches_the_gate(
    tmp_path: Path,
) -> None:
    run = _make(tmp_path, "VENV_MODE=system")
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Error 4" in out, out  # pytest's usage error: no CUDA here
    assert "CUDA is not usable" in out and gpu_gate.ALLOW_ENV in out, out
    assert "installing" not in out and not (tmp_path / "site").exists(), out


@pytest.mark.spec("HARN-24")
@pytest.mark.slow  # long; make test-thorough runs it
def test_a_missing_dependency_comes_from_the_wheel_folder_offline(tmp_path: Path) -> None:
    _tiny_wheel(tmp_path / "wheels", "refdcp_gpu_probe", "refdcp-gpu-probe")
    deps = "GPU_DEPS=refdcp_gpu_probe:refdcp-gpu-probe crc32c:crc32c"
    run = _make(tmp_path, "VENV_MODE=system", deps)
    out = run.stdout + run.stderr
    assert "installing from" in out and "refdcp-gpu-probe" in out, out
    assert "crc32c" not in out.split("installing from", 1)[1].splitlines()[0], out  # present
    assert (tmp_path / "site" / "refdcp_gpu_probe.py").is_file(), out
    assert "Error 4" in out and "CUDA is not usable" in out, out
    again = _make(tmp_path, "VENV_MODE=system", deps)  # now found in GPU_SITE: nothing to do
    assert "installing" not in again.stdout + again.stderr


@pytest.mark.spec("HARN-24")
def test_a_dependency_with_no_wheel_stops_before_pytest(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    run = _make(tmp_path, "VENV_MODE=system", "GPU_DEPS=refdcp_no_such_mod:refdcp-no-such-dist")
    out = run.stdout + run.stderr
    assert "Error 3" in out and "no wheel for it" in out and "make gpu-wheels" in out, out
    assert "gpu_gate" not in out.split("installing from", 1)[1], out  # pytest never started
