"""Reliability: every refusal names the key, at save time when a value could never load (SAVE-12..14).

Issue 11 item 7: meta tensors, sparse COO/CSR tensors, locks, lambdas and
generators failed at save without naming the key; a user-class object or a
numpy array saved fine and could never be loaded with the defaults
(weights_only unpickling), with an error that did not name the key.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner
from refdcp.planning.loadable import (
    UnloadableValueError,
    check_loadable,
    default_safe_globals,
    loadability_problem,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Sparse CSR tensor support")


class UserThing:
    """A user class: pickles, but a weights_only load refuses it."""

    def __init__(self, x: int = 1) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserThing) and other.x == self.x


def _gen() -> Any:
    yield 1


def _bad_values() -> dict[str, tuple[Any, str]]:
    """name -> (value, a phrase the refusal must contain)."""
    return {
        "meta": (torch.empty(3, device="meta"), "meta tensor"),
        "coo": (torch.eye(3).to_sparse(), "sparse"),
        "csr": (torch.eye(3).to_sparse_csr(), "sparse"),
        "lock": (threading.Lock(), "cannot be pickled"),
        "lam": (lambda x: x, "cannot be pickled"),
        "gen": (_gen(), "cannot be pickled"),
        "user": (UserThing(), "safe_globals"),
        "user_in_list": ([1, UserThing()], "safe_globals"),
    }


@pytest.mark.spec("SAVE-12", "SAVE-13")
@pytest.mark.parametrize("name", list(_bad_values()))
def test_save_refuses_and_names_key_type_and_option(
    tmp_path: Path, name: str, impl: ModuleType
) -> None:
    value, phrase = _bad_values()[name]
    sd = {"model": {"layer": {name: value}, "ok": torch.ones(2)}, "step": 3}
    with pytest.raises(CheckpointError) as info:
        impl.save(sd, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    err = info.value
    assert err.step == "local_plan"  # refused while planning: before any byte is written
    cause = err.rank_failures[0].exception
    assert isinstance(cause, UnloadableValueError)
    text = str(err)
    assert f"'model.layer.{name}'" in text
    assert type(value).__name__ in text
    assert phrase in text
    assert "'model.ok'" not in text and "'step'" not in text
    assert not (tmp_path / "c" / ".metadata").exists()


@pytest.mark.spec("SAVE-12")
def test_numpy_values_are_refused_unless_the_default_allow_list_loads_them(
    tmp_path: Path,
    impl: ModuleType,
) -> None:
    """Whether numpy loads by default is the allow-list's decision; save and load agree on it."""
    sd = {"arr": np.arange(3), "scalar": np.float32(1.5)}
    problems = {k: loadability_problem(v) for k, v in sd.items()}
    path = str(tmp_path / "np")
    if any(problems.values()):
        with pytest.raises(CheckpointError, match=r"'arr'|'scalar'"):
            impl.save(dict(sd), checkpoint_id=path, no_dist=True)
        return
    impl.save(dict(sd), checkpoint_id=path, no_dist=True)  # pragma: no cover - with dropin's list
    dest: dict[str, Any] = {"arr": None, "scalar": None}
    impl.load(dest, checkpoint_id=path, no_dist=True)
    assert np.array_equal(dest["arr"], sd["arr"])


@pytest.mark.spec("SAVE-12")
def test_every_bad_key_is_listed_at_once_on_every_rank(tmp_path: Path, impl: ModuleType) -> None:
    def rank_main(comm: Any) -> Any:
        sd = {"w": torch.ones(2), "lam": lambda: comm.rank, "meta": torch.empty(1, device="meta")}
        return impl.save(sd, checkpoint_id=str(tmp_path / "c"), comm=comm)

    errors = FakeWorld(2, timeout=30).run(rank_main, return_exceptions=True)
    for err in errors:
        assert isinstance(err, CheckpointError)
        assert sorted(err.rank_failures) == [0, 1]
        for f in err.rank_failures.values():
            assert "'lam'" in str(f.exception) and "'meta'" in str(f.exception)


@pytest.mark.spec("SAVE-12")
def test_plain_values_pass_without_a_round_trip() -> None:
    for value in (1, 2.5, "s", b"b", None, [1, (2, {"a": None})], torch.zeros(2), {"k": [1.0]}):
        assert loadability_problem(value) is None
        check_loadable("k", value)
    assert isinstance(default_safe_globals(), list)


@pytest.mark.spec("SAVE-12", "SAVE-14")
def test_allowed_user_type_saves_and_a_load_without_it_names_the_key(
    tmp_path: Path, impl: ModuleType
) -> None:
    path = str(tmp_path / "u")
    planner = DefaultSavePlanner(safe_globals=[UserThing])
    impl.save({"cfg": {"thing": UserThing(5)}}, checkpoint_id=path, no_dist=True, planner=planner)
    with pytest.raises(CheckpointError) as info:
        impl.load({"cfg": {"thing": None}}, checkpoint_id=path, no_dist=True)
    text = str(info.value)
    assert "'cfg.thing'" in text and "safe_globals" in text and "allow_pickle" in text
    dest: dict[str, Any] = {"cfg": {"thing": None}}
    impl.load(dest, checkpoint_id=path, no_dist=True, planner=DefaultLoadPlanner(allow_pickle=True))
    assert dest["cfg"]["thing"] == UserThing(5)


@pytest.mark.spec("ASYNC-17")
@pytest.mark.parametrize("name", ["meta", "coo", "lock", "gen"])
def test_async_save_staging_refusal_names_the_key(
    tmp_path: Path, name: str, impl: ModuleType
) -> None:
    value, phrase = _bad_values()[name]
    with pytest.raises(UnloadableValueError) as info:
        handle = impl.async_save(
            {"model": {name: value}}, checkpoint_id=str(tmp_path), no_dist=True
        )
        handle.result(timeout=60)
    assert f"'model.{name}'" in str(info.value) and phrase in str(info.value)
