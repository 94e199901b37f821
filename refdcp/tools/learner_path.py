"""How much code a learner reads to follow one save and one load (REF-5).

``python -m refdcp.tools.learner_path`` traces the lines executed by a 4-rank
FakeWorld save of a small model (a replicated linear layer given as a
``Stateful``, a row-sharded embedding as ``LocalShards``, a step counter and
nested optimizer-like state) and a 3-rank resharding load of it, each rank
building its own state inside the trace, and prints every refdcp module that
ran with its code lines (non-blank, non-comment, non-docstring lines of the
whole module), then a second figure with ``async_save`` in place of ``save``
when the implementation has one (``--async``: that figure alone). ``--fast``
measures ``refdcp.save``/``refdcp.load`` instead of ``refdcp.reference``;
``--torch`` measures torch's own ``dcp.save``/``dcp.load`` (one process, no
process group) for comparison.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tempfile
import threading
import tokenize
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

__all__ = ["code_lines", "learner_path", "main", "traced_files"]

#: The budget REF-5 states for the reference path.
MAX_MODULES = 15
MAX_CODE_LINES = 2500


def code_lines(path: Path) -> int:
    """Lines of ``path`` holding code: not blank, not only a comment, not in a docstring."""
    source = path.read_text(encoding="utf-8")
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def traced_files(run: Callable[[], Any], under: Path) -> set[Path]:
    """The files under ``under`` whose code ran during ``run()``, on any thread."""
    seen: set[str] = set()
    prefix = str(under)

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code.co_filename.startswith(prefix):
            seen.add(frame.f_code.co_filename)

    outer, outer_threads = sys.gettrace(), threading.gettrace()
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        run()
    finally:  # the caller's tracers (a debugger, coverage, the mutation baseline) come back
        sys.settrace(outer)
        threading.settrace(outer_threads)
    return {Path(f) for f in seen}


def _model(api: Any, rank: int, world: int, zeros: bool) -> dict[str, Any]:
    """What a training script checkpoints, built by the caller: a model (a replicated
    linear layer, a top-level ``Stateful``), a row-sharded embedding as ``LocalShards``,
    a step counter and nested optimizer-like state."""
    linear = torch.nn.Linear(4, 3)
    table = torch.arange(48.0).reshape(12, 4) * (0 if zeros else 1)
    with torch.no_grad():  # the same weights on every rank: a replicated layer
        linear.weight.copy_(torch.arange(12.0).reshape(3, 4) * (0 if zeros else 1))
        linear.bias.fill_(0 if zeros else 1)
    rows = -(-12 // world)
    start = min(rank * rows, 12)
    stop = min(start + rows, 12)
    shard = [((start, 0), table[start:stop].clone())] if stop > start else []
    moment = torch.zeros(3, 4) if zeros else torch.full((3, 4), 0.5)
    return {
        "model": linear,
        "embedding": _local_shards(api)((12, 4), shard, dtype=torch.float32),
        "step": 0 if zeros else 7,
        "optim": {
            "state": {"linear.weight": {"exp_avg": moment, "step": 0 if zeros else 7}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": ["linear.weight"]}],
        },
    }


def _check_loaded(loaded: Any, saved: dict[str, Any]) -> None:
    """The measured load put back every value the save stored (REF-5 measures a working run)."""
    same = (
        torch.equal(loaded["model"].weight, saved["model"].weight)
        and all(
            torch.equal(a[1], b[1])
            for a, b in zip(loaded["embedding"].chunks, saved["embedding"].chunks)
        )
        and loaded["step"] == saved["step"]
        and repr(loaded["optim"]) == repr(saved["optim"])
    )
    if not same:
        raise AssertionError(f"the measured load did not load what was saved: {loaded}")


def _local_shards(api: Any) -> Any:
    """The implementation's ``LocalShards``: a caller builds its shards with it."""
    if hasattr(api, "LocalShards"):
        return api.LocalShards
    from refdcp.planning import LocalShards  # TODO: until refdcp.reference exports its own

    return LocalShards


def learner_path(impl: str = "reference", asynchronous: bool = False) -> dict[Path, int]:
    """Every refdcp module that one save at 4 ranks (``async_save`` when ``asynchronous``)
    and one load at 3 ran, the caller's construction of its state included, with its code
    lines."""
    import refdcp
    import refdcp.reference
    from refdcp.comm import FakeWorld

    api: Any = refdcp.reference if impl == "reference" else refdcp
    root = Path(refdcp.__file__).parent
    with tempfile.TemporaryDirectory() as path:

        def save_one(c: Any) -> object:
            state = _model(api, c.rank, 4, False)
            if asynchronous:
                return api.async_save(state, checkpoint_id=path, comm=c).result()
            return api.save(state, checkpoint_id=path, comm=c)

        def load_one(c: Any) -> object:
            state = _model(api, c.rank, 3, True)
            api.load(state, checkpoint_id=path, comm=c)
            return state

        def save() -> list[Any]:
            return FakeWorld(4).run(save_one)

        def load() -> list[Any]:
            return FakeWorld(3).run(load_one)

        save()  # once untraced: imports and caches are not the path
        for rank, loaded in enumerate(load()):  # ... and a check that it loads what it saved
            _check_loaded(loaded, _model(api, rank, 3, False))
        files = _traced(save, root) | _traced(load, root)
    return {f.relative_to(root): code_lines(f) for f in sorted(files)}


def _traced(step: Callable[[], object], root: Path) -> set[Path]:
    """The modules ``step`` ran, leaving out this tool's own lambdas (they start the ranks)."""
    return {f for f in traced_files(step, root) if f != Path(__file__).resolve()}


def _torch_path() -> dict[Path, int]:
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

    root = Path(state_dict_saver.__file__).parent
    model = {"linear": {"weight": torch.ones(3, 4), "bias": torch.ones(3)}, "step": 7}
    with tempfile.TemporaryDirectory() as path:

        def save() -> None:
            state_dict_saver.save(model, checkpoint_id=path, no_dist=True)

        def load() -> None:
            state_dict_loader.load(model, checkpoint_id=path, no_dist=True)

        save()
        load()
        files = traced_files(save, root) | traced_files(load, root)
    return {f.relative_to(root): code_lines(f) for f in sorted(files)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--fast", action="store_true", help="measure refdcp.save/load")
    which.add_argument("--torch", action="store_true", help="measure torch's dcp.save/load")
    parser.add_argument(
        "--async", dest="asynchronous", action="store_true", help="measure async_save, not save"
    )
    args = parser.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore")
    impl = "fast" if args.fast else "reference"
    path = _torch_path() if args.torch else learner_path(impl, args.asynchronous)
    for module, n in path.items():
        print(f"{n:6d}  {module}")
    print(f"{len(path)} modules, {sum(path.values())} code lines")
    if not (args.torch or args.asynchronous) and hasattr(_api(impl), "async_save"):
        with_async = learner_path(impl, asynchronous=True)
        print(f"with async_save: {len(with_async)} modules, {sum(with_async.values())} code lines")
    return 0


def _api(impl: str) -> Any:
    import refdcp
    import refdcp.reference

    return refdcp.reference if impl == "reference" else refdcp


if __name__ == "__main__":
    raise SystemExit(main())
