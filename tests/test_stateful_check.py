"""The fast Stateful check agrees with torch's runtime protocol (spec/protocol.md SAVE-1, LOAD-1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.driver.steps import is_stateful


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


class _StatefulTensor(torch.Tensor):
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@pytest.mark.spec("SAVE-1", "LOAD-1")
@pytest.mark.parametrize(
    "value",
    [
        torch.ones(2),
        torch.nn.Parameter(torch.ones(2)),
        1,
        1.5,
        True,
        "s",
        b"b",
        None,
        {"a": 1},
        [1],
        (1,),
        _Counter(),
        torch.nn.Linear(2, 2),
        torch.ones(2).as_subclass(_StatefulTensor),
        object(),
    ],
    ids=lambda v: type(v).__name__,
)
def test_matches_torch_protocol(value: object) -> None:
    assert is_stateful(value) == isinstance(value, Stateful)
