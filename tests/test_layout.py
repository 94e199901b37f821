"""The package layout: old module paths keep importing (spec/api.md, API-8)."""

from __future__ import annotations

import importlib

import pytest

from refdcp._moved import MOVED


@pytest.mark.spec("API-8")
@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_is_the_new_module(old: str) -> None:
    new_module = importlib.import_module(MOVED[old])
    old_module = importlib.import_module(old)
    assert old_module is new_module


@pytest.mark.spec("API-8")
def test_old_from_import_gives_the_same_objects() -> None:
    from refdcp.checkpointer import Checkpointer as old_cls  # type: ignore[import-not-found]
    from refdcp.state_dict import get_state_dict as old_fn  # type: ignore[import-not-found]

    from refdcp.asyncsave.checkpointer import Checkpointer as new_cls
    from refdcp.state.state_dict import get_state_dict as new_fn

    assert old_cls is new_cls
    assert old_fn is new_fn
