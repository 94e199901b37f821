"""Golden checkpoints written by torch's own ``dcp.save``, one per torch minor version (TOOL-30).

This module imports torch and the standard library only, so it runs under any torch of the
range. ``python tests/torch_golden.py OUT`` saves :func:`golden_state_dict` with
``torch.distributed.checkpoint.save`` and torch's ``FileSystemWriter`` at world size 2 (two
Gloo processes; DTensors sharded across both ranks, plain tensors replicated on both), then
writes ``OUT/manifest.json``: the torch version, the world size, and for every tensor key its
dtype, shape and the SHA-256 of its bytes. ``tests/golden/torch/README.md`` says how each
committed fixture was made; ``tests/test_torch_golden.py`` loads them all with ``refdcp.load``.

Every value is built from integers (bit patterns viewed as the dtype), never from arithmetic
that a torch version could round differently, so every torch builds the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

WORLD_SIZE = 2

#: every dtype torch's DCP serialises (float4_e2m1fn_x2 packs two values in a byte)
DTYPE_NAMES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]


def pattern(dtype: torch.dtype, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """A tensor whose bytes are ``(7 * i + salt) % 251`` (``% 2`` for bool), viewed as dtype."""
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = (torch.arange(n * itemsize, dtype=torch.int64) * 7 + salt) % 251
    if dtype == torch.bool:
        raw = raw % 2
    return raw.to(torch.uint8).view(dtype).reshape(shape)


def golden_state_dict() -> dict[str, Any]:
    """The full (unsharded) state dict every fixture holds, built the same on every torch."""
    sd: dict[str, Any] = {}
    for i, name in enumerate(DTYPE_NAMES):
        sd[f"dtypes.{name}"] = pattern(getattr(torch, name), (4, 6), i)
    sd["model.sharded_rows"] = pattern(torch.float32, (8, 5), 50)  # Shard(0) over 2 ranks
    sd["model.sharded_cols"] = pattern(torch.bfloat16, (3, 10), 51)  # Shard(1) over 2 ranks
    sd["model.replicated"] = pattern(torch.float32, (6,), 52)
    sd["model.empty"] = torch.empty((0,), dtype=torch.float32)
    sd["model.empty_2d"] = torch.empty((0, 3), dtype=torch.int64)
    sd["model.scalar"] = pattern(torch.float64, (), 53)
    sd["optim"] = {
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "exp_avg": pattern(torch.float32, (8, 5), 60),
                "exp_avg_sq": pattern(torch.float32, (8, 5), 61),
            },
            1: {
                "step": torch.tensor(3.0),
                "exp_avg": pattern(torch.float32, (6,), 62),
                "exp_avg_sq": pattern(torch.float32, (6,), 63),
            },
        },
        "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0, 1], "name": "g"}],
    }
    sd["extra"] = {"epoch": 7, "loss": 0.25, "tag": "golden", "flags": [True, None], "blob": b"\x00\xff"}
    return sd


SHARDED = {"model.sharded_rows": 0, "model.sharded_cols": 1}


def tensor_items(sd: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) for every tensor in ``sd``, in a fixed order."""
    out: list[tuple[str, torch.Tensor]] = []
    items = sd.items() if isinstance(sd, dict) else enumerate(sd)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out.append((key, v))
        elif isinstance(v, (dict, list)):
            out.extend(tensor_items(v, key + "."))
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in row-major order."""
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank_main(rank: int, out: str, store_path: str) -> None:
    # saved from inside OUT as ".", so the metadata records no machine's path
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        sd = golden_state_dict()
        for key, dim in SHARDED.items():
            sd[key] = distribute_tensor(sd[key], mesh, [Shard(dim)])
        os.chdir(out)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter("."))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write(out: Path) -> None:
    """Save the golden state dict with torch at world size 2 into ``out`` plus its manifest."""
    out.mkdir(parents=True, exist_ok=False)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank_main, args=(r, str(out), os.path.join(tmp, "store")))
            for r in range(WORLD_SIZE)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.exitcode != 0:
                raise SystemExit(f"a rank failed (exit {p.exitcode})")
    sd = golden_state_dict()
    manifest = {
        "torch": torch.__version__,
        "world_size": WORLD_SIZE,
        "writer": "torch.distributed.checkpoint.save + FileSystemWriter (defaults)",
        "sharded": SHARDED,
        "tensors": {
            k: {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": tensor_digest(t)}
            for k, t in tensor_items(sd)
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/torch_golden.py OUT_DIR")
    write(Path(sys.argv[1]))
