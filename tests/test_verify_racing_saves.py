"""``refdcp verify`` gives a verdict on one committed checkpoint while saves replace it (INTEG-14).

A save that commits into the directory being verified reclaims the data files of the
checkpoint it replaced. A verify that read the old ``.metadata`` then finds its files
gone: that is not damage, and it must not be reported as such.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp
from refdcp.storage import verify as verify_module
from refdcp.storage.errors import CheckpointReplacedError
from refdcp.tools.verify import verify_command

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is not initialized")
SINGLE_PATH = "refdcp.verify_checkpoint racing saves that replace and reclaim a checkpoint; the reference never reclaims (REF-8)"


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, generator=g) for i in range(4)} | {"step": seed}


@pytest.fixture
def saves_during_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every time verify opens its first data file, a save replaces the checkpoint
    (while the list holds more entries: one is used per replacement)."""
    pending: list[int] = []
    real = verify_module._FileRanges.__call__

    def racing(self: Any, name: str, offset: int, length: int) -> bytes | None:
        if self.name is None and pending:
            refdcp.save(_state(pending.pop()), checkpoint_id=self.root)
        return real(self, name, offset, length)

    monkeypatch.setattr(verify_module._FileRanges, "__call__", racing)
    yield pending


@pytest.mark.spec("INTEG-14")
@pytest.mark.parametrize("replacements", [1, 2])
def test_a_checkpoint_replaced_while_verified_is_checked_again_not_called_corrupt(
    tmp_path: Path, saves_during_checks: list[int], replacements: int
) -> None:
    refdcp.save(_state(0), checkpoint_id=tmp_path)
    saves_during_checks.extend(range(1, 1 + replacements))
    report = refdcp.verify_checkpoint(tmp_path)
    assert not saves_during_checks, "the planted saves ran"
    assert report.ok, report.problems
    assert report.items_checked == 5  # the new checkpoint, checked whole
    assert verify_command(str(tmp_path), json=False) == 0


@pytest.mark.spec("INTEG-14")
def test_a_checkpoint_replaced_at_every_check_gets_no_verdict(
    tmp_path: Path, saves_during_checks: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    refdcp.save(_state(0), checkpoint_id=tmp_path)
    saves_during_checks.extend(range(1, 1 + verify_module.ATTEMPTS))
    with pytest.raises(CheckpointReplacedError, match="replaced while verifying it, 3 times"):
        refdcp.verify_checkpoint(tmp_path)
    saves_during_checks.extend(range(10, 10 + verify_module.ATTEMPTS))
    assert verify_command(str(tmp_path), json=False) == 2
    err = capsys.readouterr().err
    assert "replaced while verifying" in err and "CORRUPT" not in err


@pytest.mark.spec("INTEG-14")
def test_damage_is_still_reported_when_nothing_replaced_the_checkpoint(tmp_path: Path) -> None:
    """The retry is only for a replaced ``.metadata``: a missing file of the committed
    checkpoint is reported as before."""
    refdcp.save(_state(0), checkpoint_id=tmp_path)
    (data,) = tmp_path.glob("*.distcp")
    data.unlink()
    report = refdcp.verify_checkpoint(tmp_path)
    assert not report.ok
    assert {p.message for p in report.problems} == {"data file missing"}


_SAVER = """
import sys, warnings, torch, refdcp

warnings.simplefilter("ignore")
path, seed = sys.argv[1], 1
while True:
    g = torch.Generator().manual_seed(seed)
    refdcp.save({f"w{i}": torch.randn(1 << 16, generator=g) for i in range(8)}, checkpoint_id=path)
    print(seed, flush=True)
    seed += 1
"""


@pytest.mark.spec("INTEG-14")
def test_verify_racing_real_saves_never_reports_an_intact_checkpoint_damaged(
    tmp_path: Path,
) -> None:
    """Another process commits save after save into the directory while it is verified
    over and over: every verdict is OK or "replaced while verifying", never damage."""
    refdcp.save(_state(0), checkpoint_id=tmp_path)
    saver = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    verdicts = {"ok": 0, "replaced": 0}
    try:
        assert saver.stdout is not None
        saver.stdout.readline()  # the saver is committing
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline or verdicts["ok"] == 0:
            try:
                report = refdcp.verify_checkpoint(tmp_path)
            except CheckpointReplacedError:
                verdicts["replaced"] += 1
                continue
            assert report.ok, (verdicts, report.problems)
            verdicts["ok"] += 1
    finally:
        saver.kill()
        saver.wait()
    assert verdicts["ok"] > 0, verdicts
