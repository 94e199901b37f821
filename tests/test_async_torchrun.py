"""``async_save`` under ``torchrun``, as torch users launch it (ASYNC-32, ASYNC-1).

``tests/_torchrun_async.py`` runs at 1 and 2 ranks launched by torchrun (which
sets ``TORCHELASTIC_USE_AGENT_STORE=True`` for its trainers): the process
executor, the thread executor and torch's ``DefaultStager`` each save and load
back. Every process the launch started is killed at the end, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SINGLE_PATH = (
    "launches refdcp.async_save in torchrun's processes; the reference's twin runs in-process"
)

SCRIPT = Path(__file__).with_name("_torchrun_async.py")
ROOT = SCRIPT.parent.parent


@pytest.mark.spec("ASYNC-32", "ASYNC-1", "ASYNC-7")
@pytest.mark.parametrize("ranks", [1, 2])
def test_async_save_under_torchrun_with_every_executor(tmp_path: Path, ranks: int) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(ranks), str(SCRIPT), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its trainers and their workers
    assert proc.returncode == 0, out[-4000:]
    for rank in range(ranks):
        for flavour in ("process", "thread", "default_stager"):
            assert f"rank {rank}/{ranks} {flavour} ok" in out, out[-4000:]
