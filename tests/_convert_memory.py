"""Peak memory of ``refdcp convert`` in a fresh process (TOOL-19); run as a script.

``python tests/_convert_memory.py WORKDIR N MIB [--torch]`` writes a checkpoint
of N float32 tensors of MIB MiB each (DCP, torch.save and safetensors), then
converts in every direction and prints one JSON object: for each direction,
the peak resident memory above the resident memory before it (the peak is
reset through ``/proc/self/clear_refs`` before each conversion), in bytes.
With ``--torch`` it also measures torch's ``dcp_to_torch_save`` and
``torch_save_to_dcp`` the same way, for comparison.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def measure(fn: Callable[[], object]) -> int:
    """Peak RSS during ``fn`` minus RSS before it, in bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def main(argv: list[str]) -> None:
    import torch

    import refdcp
    from refdcp.tools.convert import convert

    workdir, n, mib = Path(argv[0]), int(argv[1]), int(argv[2])
    with_torch = "--torch" in argv
    torch.manual_seed(0)
    state = {
        "layers": {str(i): torch.randn(mib << 18) for i in range(n)},  # mib MiB of float32
        "step": 7,
    }
    src_dcp = workdir / "src_dcp"
    refdcp.save(state, checkpoint_id=str(src_dcp))
    del state
    gc.collect()
    # warm up every code path on a tiny checkpoint so imports are not counted
    tiny = workdir / "tiny"
    refdcp.save({"t": torch.ones(4), "s": 1}, checkpoint_id=str(tiny / "d"))
    convert(tiny / "d", tiny / "a.pt")
    convert(tiny / "a.pt", tiny / "b")
    convert(tiny / "d", tiny / "c.safetensors", drop_non_tensors=True)
    convert(tiny / "c.safetensors", tiny / "e")
    convert(tiny / "c.safetensors", tiny / "f.pt")
    convert(tiny / "a.pt", tiny / "g.safetensors", drop_non_tensors=True)
    out: dict[str, int] = {"largest_tensor": mib << 20, "total": n * (mib << 20)}

    def run(name: str, src: Path, dst: Path, **kw: object) -> None:
        out[name] = measure(lambda: convert(src, dst, **kw))  # type: ignore[arg-type]

    run("dcp->torch", src_dcp, workdir / "a.pt")
    run("dcp->safetensors", src_dcp, workdir / "a.safetensors", drop_non_tensors=True)
    run("torch->dcp", workdir / "a.pt", workdir / "b_dcp")
    run("torch->safetensors", workdir / "a.pt", workdir / "b.safetensors", drop_non_tensors=True)
    run("safetensors->dcp", workdir / "a.safetensors", workdir / "c_dcp")
    run("safetensors->torch", workdir / "a.safetensors", workdir / "c.pt")
    if with_torch:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(tiny / "d", tiny / "t.pt")
            torch_save_to_dcp(tiny / "t.pt", tiny / "t_dcp")
            out["torch dcp_to_torch_save"] = measure(
                lambda: dcp_to_torch_save(src_dcp, workdir / "t.pt")
            )
            out["torch torch_save_to_dcp"] = measure(
                lambda: torch_save_to_dcp(workdir / "a.pt", workdir / "t_dcp")
            )
    shutil.rmtree(tiny)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
