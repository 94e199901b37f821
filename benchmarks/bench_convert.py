"""``refdcp convert`` peak memory beside torch's ``format_utils`` (TOOL-19).

Runs ``tests/_convert_memory.py`` in a fresh process: a checkpoint of N float32
tensors of M MiB each, converted in every direction; for each conversion the
peak resident memory above the resident memory before it (the peak is reset
through ``/proc/self/clear_refs``). torch's ``dcp_to_torch_save`` and
``torch_save_to_dcp`` are measured the same way in the same process. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "_convert_memory.py"


def measure(tensors: int, mib: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="refdcp-bench-convert-") as work:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), work, str(tensors), str(mib), "--torch"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
    figures: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_convert")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--mib", type=int, default=32, help="MiB per tensor")
    a, _ = p.parse_known_args(argv)
    figures = measure(a.tensors, a.mib)
    largest, total = figures.pop("largest_tensor"), figures.pop("total")
    print(
        f"{a.tensors} tensors x {a.mib} MiB (largest {largest >> 20} MiB, total {total >> 20} MiB)"
    )
    print("| conversion | extra peak RSS MiB | / largest tensor |")
    print("|---|---|---|")
    for name, extra in figures.items():
        print(f"| {name} | {extra / 2**20:.1f} | {extra / largest:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
