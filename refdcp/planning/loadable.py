"""Save-time refusal of values that cannot be saved or could never load with the defaults (SAVE-12..SAVE-14).

A value is stored either as tensor chunks or as ``torch.save`` bytes that a
default load reads with ``torch.load(weights_only=True)``. A value that
fails either way is refused when the save plans, before anything is written,
with an error that names its key path, its type and the option that allows
it. The allow-list of a default load is :func:`default_safe_globals` (one
function, so the load side and this check agree); ``safe_globals`` passed to
the save planner extends it for types the caller will also allow at load.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from refdcp.planning.errors import UnloadableValueError
from refdcp.storage.metadata.limits import get_metadata_limits
from refdcp.storage.metadata.safe_globals import default_safe_globals, load_weights_only

__all__ = [
    "UnloadableValueError",
    "check_loadable",
    "default_safe_globals",
    "loadability_problem",
    "refuse_unloadable",
    "staging_refusal",
]


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.is_meta:
        return (
            "a meta tensor has no values; materialise it (for example module.to_empty(device=...) "
            "and initialise it) before saving"
        )
    if t.layout != torch.strided:
        return (
            f"sparse tensors (layout {t.layout}) are not supported by DCP; "
            "save t.to_dense(), or its indices and values as separate tensors"
        )
    return None


def loadability_problem(value: Any, safe_globals: Sequence[Any] = ()) -> str | None:
    """Why ``value`` cannot be saved or loaded back with the defaults, or None (SAVE-12, SAVE-13)."""
    if isinstance(value, torch.Tensor):
        inner = getattr(value, "_local_tensor", None)  # a DTensor's local shard
        return _tensor_problem(inner if isinstance(inner, torch.Tensor) else value)
    if hasattr(value, "__create_write_items__"):
        return None  # saved through its own write items, not pickled
    if _plain_data(value, [10_000]):
        return None
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as exc:
        return f"cannot be pickled ({type(exc).__name__}: {exc}); convert it to plain data"
    buf.seek(0)
    try:
        load_weights_only(buf, list(safe_globals))
    except Exception as exc:
        first = _unpickler_reason(exc)
        return f"saves, but a default load (weights_only=True) cannot unpickle it ({first}); " + (
            allowing_options(_type_name(value))
        )
    return None


_PRIMITIVES = (int, float, bool, str, bytes, complex, type(None))
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def _plain_data(value: Any, budget: list[int]) -> bool:
    """True for primitives and plain containers of them and dense tensors: loadable by design.

    Skips the pickle round trip for the common case; ``budget`` bounds the walk.
    """
    budget[0] -= 1
    if budget[0] < 0:
        return False
    t = type(value)
    if t in _PRIMITIVES:
        return True
    if t in (list, tuple):
        return all(_plain_data(v, budget) for v in value)
    if t is dict:
        return all(_plain_data(k, budget) and _plain_data(v, budget) for k, v in value.items())
    if t is torch.Tensor:
        return _tensor_problem(value) is None and not value.is_quantized
    return False


def _unpickler_reason(exc: BaseException) -> str:
    """The informative line of torch's weights_only error (which global was refused)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "WeightsUnpickler error:" in ln:
            return ln.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0]
    return lines[0] if lines else type(exc).__name__


def allowing_options(type_name: str) -> str:
    """The options that let a value of ``type_name`` through, for error messages (SAVE-12)."""
    return (
        f"to keep it, allow {type_name} at save with DefaultSavePlanner(safe_globals=[...]) and "
        "at load with safe_globals=[...] (or DefaultLoadPlanner(allow_pickle=True) for a "
        "trusted checkpoint), or convert it to plain data (dict, list, str, int, float, tensor)"
    )


def staging_refusal(key: str, value: Any, exc: BaseException) -> UnloadableValueError:
    """A stager's failure to copy a value, naming its key, type and cause (ASYNC-17)."""
    why = f"cannot be staged ({type(exc).__name__}: {exc})"
    problem = loadability_problem(value)
    if problem is not None:
        why += f"; {problem}"
    return UnloadableValueError([f"key {key!r}, type {_type_name(value)}: {why}"])


def check_loadable(key: str, value: Any, safe_globals: Sequence[Any] = ()) -> None:
    """Raise :class:`UnloadableValueError` naming ``key`` unless ``value`` saves and loads (SAVE-12)."""
    refuse_unloadable({key: value}, safe_globals)


def refuse_unloadable(
    items: Mapping[str, Any],
    safe_globals: Sequence[Any] = (),
    paths: Mapping[str, Iterable[Any]] | None = None,
) -> None:
    """Check every flattened value; raise one :class:`UnloadableValueError` listing all (SAVE-12)."""
    problems = []
    cap = get_metadata_limits().max_string_chars
    for key, value in items.items():
        if len(key) > cap:  # SAVE-17: a default load refuses the string (FMT-10)
            problems.append(
                f"key {key[:80]!r}... ({len(key)} characters): longer than the {cap} characters "
                "a default load accepts in .metadata (REFDCP_MAX_METADATA_STRING); use a shorter key"
            )
            continue
        if type(value) in _PLAIN_TENSORS and not value.is_meta and value.layout == _STRIDED:
            continue  # a dense plain tensor: _tensor_problem's answer, without the calls
        why = loadability_problem(value, safe_globals)
        if why is not None:
            path = list(paths[key]) if paths is not None and key in paths else None
            plain = path is None or [str(p) for p in path] == key.split(".")
            where = f"{key!r}" + ("" if plain else f" (path {path})")
            problems.append(f"key {where}, type {_type_name(value)}: {why}")
    if problems:
        raise UnloadableValueError(problems)
