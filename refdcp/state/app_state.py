"""``AppState``: a model and its optimizers as one ``Stateful`` (spec/tooling.md, SD-10).

Put ``{"app": AppState(model, optimizer)}`` into the state dict given to
``save``/``load`` (refdcp's or torch's); DCP then calls :meth:`state_dict` for
the values to save (or the destinations to load into) and
:meth:`load_state_dict` once the values are read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.state.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

__all__ = ["AppState"]


class AppState(Stateful):
    """Model + optimizer(s) under the keys ``"model"`` and ``"optim"`` (SD-10)."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizers: tuple[torch.optim.Optimizer, ...] = (
            (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        )
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}) if self.optimizers else {},
            options=self.options,
        )
