"""Checkpoints written by every torch minor version of the supported range load bit-exact (TOOL-30).

The fixtures under ``tests/golden/torch/<minor>/`` were saved by torch's own ``dcp.save`` at
world size 2 (``tests/torch_golden.py``; ``tests/golden/torch/README.md`` says how). Here, with
refdcp's default torch, ``refdcp.load`` reads each one into full tensors (the two ranks' shards
resharded into one), and every tensor must equal :func:`golden_state_dict` bit for bit and the
SHA-256 its writer recorded, and every non-tensor value must come back equal.
"""

from __future__ import annotations

import json
import re
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.torch_golden import golden_state_dict, tensor_digest, tensor_items

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "torch"
FIXTURES = sorted(p.parent for p in GOLDEN.glob("*/manifest.json"))


def _template(sd: Any) -> Any:
    """The state dict to load into: zeroed tensors of the same dtype and shape, other values None."""
    if isinstance(sd, dict):
        return {k: _template(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_template(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _tested_minors() -> list[str]:
    """Every torch minor ``2.M`` that pyproject's torch range admits (it must have an upper bound)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r'"torch>=2\.(\d+)(?:\.\d+)?,<2\.(\d+)"', text)
    assert m, "pyproject.toml's torch requirement must read torch>=2.A,<2.B"
    return [f"2.{minor}" for minor in range(int(m.group(1)), int(m.group(2)))]


@pytest.mark.spec("TOOL-30")
def test_every_minor_of_the_stated_range_has_a_fixture() -> None:
    have = {p.name for p in FIXTURES}
    assert have, "no golden torch checkpoints under tests/golden/torch"
    assert set(_tested_minors()) <= have, (sorted(have), _tested_minors())
    for p in FIXTURES:
        written_by = json.loads((p / "manifest.json").read_text())["torch"]
        assert written_by.startswith(p.name + "."), (p.name, written_by)


@pytest.mark.spec("TOOL-30")
@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.name for p in FIXTURES])
def test_a_torch_written_golden_checkpoint_loads_bit_exact(fixture: Path, impl: ModuleType) -> None:
    manifest = json.loads((fixture / "manifest.json").read_text())
    expected = golden_state_dict()
    got = _template(expected)
    impl.load(got, checkpoint_id=str(fixture), no_dist=True)

    want_tensors = dict(tensor_items(expected))
    got_tensors = dict(tensor_items(got))
    assert set(manifest["tensors"]) == set(want_tensors) == set(got_tensors)
    for key, want in want_tensors.items():
        t = got_tensors[key]
        assert t.dtype == want.dtype and t.shape == want.shape, key
        assert torch.equal(_bits(t), _bits(want)), key
        assert tensor_digest(t) == manifest["tensors"][key]["sha256"], key
    assert got["extra"] == expected["extra"]
    assert got["optim"]["param_groups"] == expected["optim"]["param_groups"]


def _make_n(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = ["make", "-n", "--no-print-directory", "-C", str(ROOT), "test-torch", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.spec("TOOL-31")
def test_make_test_torch_pins_the_version_in_a_venv_of_its_own() -> None:
    plan = _make_n("TORCH=2.11.0").stdout
    assert "-m venv build/torch-2.11.0" in plan, plan
    assert (
        'pip install -q "torch==2.11.0"' in plan and "-c build/torch-2.11.0/constraints.txt" in plan
    )
    assert "== '2.11.0'" in plan  # the version it got is checked before any test runs
    assert 'build/torch-2.11.0/bin/python -m pytest -n 2 -m "not slow and not gpu"' in plan
    assert ".venv" not in plan.replace("-m venv", "")
    chosen = _make_n("TORCH=2.12.0", "TORCH_TESTS=tests/test_api.py").stdout
    assert chosen.rstrip().endswith("-q tests/test_api.py"), chosen


@pytest.mark.spec("TOOL-31")
@pytest.mark.parametrize("version", ["", "2.11", "latest", ">=2.11"])
def test_make_test_torch_refuses_anything_but_an_exact_version(version: str) -> None:
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), "test-torch", f"TORCH={version}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "usage: make test-torch TORCH=2.x.y" in run.stderr, run.stderr
    assert not (ROOT / "build" / f"torch-{version}").exists()
