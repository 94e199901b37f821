"""How much code a learner reads to follow one save and one load (REF-5).

``python -m refdcp.tools.learner_path`` traces the lines executed by a 4-rank
FakeWorld save of a small model (a replicated linear layer, a row-sharded
embedding as ``LocalShards``, a step counter and nested optimizer-like state)
and a 3-rank resharding load of it, and prints every refdcp module that ran
with its code lines (non-blank, non-comment, non-docstring lines of the whole
module). ``--fast`` measures ``refdcp.save``/``refdcp.load`` instead of
``refdcp.reference``; ``--torch`` measures torch's own ``dcp.save``/``dcp.load``
(one process, no process group) for comparison.
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


def _model(rank: int, world: int, zeros: bool, api: Any) -> dict[str, Any]:
    LocalShards = api.LocalShards  # the implementation's own (REF-22)

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if zeros else t

    table = fill(torch.arange(48.0).reshape(12, 4))
    rows = -(-12 // world)
    start = min(rank * rows, 12)
    stop = min(start + rows, 12)
    shard = [((start, 0), table[start:stop].clone())] if stop > start else []
    return {
        "linear": {"weight": fill(torch.ones(3, 4)), "bias": fill(torch.ones(3))},
        "embedding": LocalShards((12, 4), shard, dtype=torch.float32),
        "optim": {"step": 0 if zeros else 7, "state": [fill(torch.full((3,), 2.0))]},
    }


def learner_path(impl: str = "reference") -> dict[Path, int]:
    """Every refdcp module that one save at 4 ranks and one load at 3 ran, with its code lines."""
    import refdcp
    import refdcp.reference
    from refdcp.comm import FakeWorld

    api: Any = refdcp.reference if impl == "reference" else refdcp
    root = Path(refdcp.__file__).parent
    with tempfile.TemporaryDirectory() as path:

        def save(states: list[dict[str, Any]]) -> Callable[[], object]:
            return lambda: FakeWorld(4).run(
                lambda c: api.save(states[c.rank], checkpoint_id=path, comm=c)
            )

        def load(states: list[dict[str, Any]]) -> Callable[[], object]:
            return lambda: FakeWorld(3).run(
                lambda c: api.load(states[c.rank], checkpoint_id=path, comm=c)
            )

        def saving() -> list[dict[str, Any]]:
            return [_model(r, 4, False, api) for r in range(4)]

        def loading() -> list[dict[str, Any]]:
            return [_model(r, 3, True, api) for r in range(3)]

        save(saving())()  # once untraced: imports and caches are not the path
        load(loading())()
        # the states are built before each trace starts: building them is not the path
        files = _traced(save(saving()), root) | _traced(load(loading()), root)
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
    args = parser.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore")
    path = _torch_path() if args.torch else learner_path("fast" if args.fast else "reference")
    for module, n in path.items():
        print(f"{n:6d}  {module}")
    print(f"{len(path)} modules, {sum(path.values())} code lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
