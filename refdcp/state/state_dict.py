"""Model and optimizer state dicts keyed by parameter FQN (spec/tooling.md, SD-*).

refdcp's own implementation covers plain ``nn.Module`` models with torch
optimizers. Anything parallelised (FSDP1/FSDP2, DDP, ``torch.compile``,
DTensor/ShardedTensor parameters) and any option refdcp does not implement
itself is handed to torch's ``torch.distributed.checkpoint.state_dict`` (SD-9).

The functions mirror torch's signatures so either can be swapped for the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _tsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from refdcp.errors import StateDictError

__all__ = [
    "StateDictError",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "uses_torch_implementation",
]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]

#: Options refdcp implements itself; any other non-default option delegates (SD-9).
_NATIVE_OPTIONS = frozenset({"strict", "ignore_frozen_params"})


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _is_distributed_tensor(t: object) -> bool:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    return isinstance(t, (DTensor, ShardedTensor))


def uses_torch_implementation(
    model: nn.Module, options: StateDictOptions | None = None, **extra: object
) -> bool:
    """True when ``model``/``options`` are handed to torch's DSD (SD-9)."""
    if any(v is not None for v in extra.values()):
        return True
    if options is not None:
        default = StateDictOptions()
        for f in fields(StateDictOptions):
            if f.name in _NATIVE_OPTIONS:
                continue
            if getattr(options, f.name) != getattr(default, f.name):
                return True
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for module in model.modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel, DistributedDataParallel)):
            return True
        if type(module).__name__ == "OptimizedModule" or hasattr(module, "_fqn_modifiers"):
            return True
    for _, t in model.named_parameters():
        if _is_distributed_tensor(t):
            return True
    return any(_is_distributed_tensor(t) for _, t in model.named_buffers())


def _strict(options: StateDictOptions | None) -> bool:
    return True if options is None else options.strict


def _param_fqns(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first FQN (tied parameters get one FQN, SD-2)."""
    return {id(p): fqn for fqn, p in model.named_parameters()}


def _fqn_list(model_fqns: dict[int, str], params: Iterable[torch.Tensor]) -> list[str]:
    out = []
    for p in params:
        fqn = model_fqns.get(id(p))
        if fqn is None:
            raise StateDictError("an optimizer holds a parameter that is not in the model")
        out.append(fqn)
    return out


# --------------------------------------------------------------------- model


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The model's state dict keyed by FQN (SD-1); frozen params dropped on request (SD-3)."""
    if uses_torch_implementation(model, options, submodules=submodules):
        return _tsd.get_model_state_dict(model, submodules=submodules, options=options)
    sd: dict[str, Any] = dict(model.state_dict())
    if options is not None and options.ignore_frozen_params:
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                sd.pop(fqn, None)
    if not sd and _strict(options) and not (options and options.ignore_frozen_params):
        raise StateDictError("model state_dict is empty but strict=True requires one (SD-4)")
    return sd


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load an FQN-keyed state dict into ``model`` (SD-5); returns missing/unexpected keys."""
    if uses_torch_implementation(model, options) or any(
        isinstance(k, nn.Module) for k in model_state_dict
    ):
        return _tsd.set_model_state_dict(model, model_state_dict, options=options)
    if not model_state_dict:
        return _IncompatibleKeys([], [])
    return cast(_IncompatibleKeys, model.load_state_dict(model_state_dict, strict=_strict(options)))


# ----------------------------------------------------------------- optimizer


@contextlib.contextmanager
def _materialised(optim: torch.optim.Optimizer) -> Iterator[None]:
    """Temporarily give a never-stepped optimizer its lazy state (SD-6).

    Like torch, this runs one ``step()`` with zero gradients and ``lr=0``.
    Unlike torch, the optimizer's state and gradients are put back afterwards,
    so calling ``get_*`` never changes later training.
    """
    params = [p for g in optim.param_groups for p in g["params"]]
    if optim.state or any(p.grad is not None for p in params):
        yield
        return
    lrs: list[Any] = []
    try:
        with torch.no_grad():
            for p in params:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            for g in optim.param_groups:
                if "lr" in g:
                    lrs.append(g["lr"])
                    g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
            try:
                optim.step()
            finally:
                for g in optim.param_groups:
                    if "lr" in g:
                        g["lr"] = lrs.pop(0)
        yield
    finally:
        optim.state.clear()
        for p in params:
            p.grad = None


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """All optimizers' state keyed by parameter FQN, param groups kept in order (SD-2, SD-6)."""
    optims = _as_tuple(optimizers)
    if uses_torch_implementation(model, options, submodules=submodules):
        return cast(
            dict[str, Any],
            _tsd.get_optimizer_state_dict(model, optims, submodules=submodules, options=options),
        )
    fqns = _param_fqns(model)
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optim in optims:
        with _materialised(optim):
            osd = optim.state_dict()
        order = _fqn_list(fqns, (p for g in optim.param_groups for p in g["params"]))
        for idx, value in osd["state"].items():
            state[order[idx]] = value
        for group in osd["param_groups"]:
            g = dict(group)
            g["params"] = [order[i] for i in group["params"]]
            groups.append(g)
    if not state and not groups:
        raise StateDictError("optimizer state_dict is empty (SD-4)")
    return {"state": state, "param_groups": groups}


def _split_for(
    optim: torch.optim.Optimizer,
    fqns: dict[int, str],
    osd: dict[str, Any],
    strict: bool,
    missing: list[str],
) -> dict[str, Any]:
    """The part of an FQN-keyed optimizer state dict that belongs to ``optim`` (SD-7)."""
    loaded_state: dict[str, Any] = osd.get("state", {})
    loaded_groups: list[dict[str, Any]] = osd.get("param_groups", [])
    group_of: dict[str, dict[str, Any]] = {}
    for g in loaded_groups:
        for f in g["params"]:
            group_of[f] = g
    empty_loaded = [g for g in loaded_groups if not g["params"]]
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for group in optim.param_groups:
        names = _fqn_list(fqns, group["params"])
        sources = {id(group_of[f]): group_of[f] for f in names if f in group_of}
        if not names:
            src: dict[str, Any] | None = empty_loaded.pop(0) if empty_loaded else None
        elif len(sources) == 1:
            src = next(iter(sources.values()))
        elif len(sources) > 1:
            raise StateDictError(f"parameters {names} come from several saved param groups")
        else:
            src = None
        if src is None:
            if strict:
                missing.append(f"param_group of {names}")
            src = group
        new_group = {k: v for k, v in src.items() if k != "params"}
        new_group["params"] = names
        groups.append(new_group)
        for f, p in zip(names, group["params"]):
            if f in loaded_state:
                state[f] = loaded_state[f]
            elif strict and p.requires_grad:
                missing.append(f)
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an FQN-keyed optimizer state dict into every optimizer (SD-7, SD-8)."""
    optims = _as_tuple(optimizers)
    if uses_torch_implementation(model, options) or "state" not in optim_state_dict:
        _tsd.set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
        return
    fqns = _param_fqns(model)
    missing: list[str] = []
    parts = [_split_for(o, fqns, optim_state_dict, _strict(options), missing) for o in optims]
    if missing:
        raise StateDictError(
            f"optimizer state_dict lacks {missing}; pass StateDictOptions(strict=False) "
            "to load anyway (SD-8)"
        )
    for optim, part in zip(optims, parts):
        optim.load_state_dict(part)


# ---------------------------------------------------------------------- both


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model state dict, optimizer state dict)``, both FQN-keyed (SD-1, SD-2)."""
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load model then optimizer state (SD-5, SD-7); returns the model's incompatible keys."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    if optim_state_dict:
        set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys
