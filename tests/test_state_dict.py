"""refdcp.state.state_dict against torch's DSD on plain models (spec/tooling.md, SD-*)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import state_dict as tsd

from refdcp.state import state_dict as rsd
from refdcp.state.app_state import AppState

OptFactory = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptFactory] = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw_wd": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Structural and value equality of nested state dicts (tensors compared exactly)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def pair(name: str) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    model = mlp()
    for _ in range(2):
        m = copy.deepcopy(model)
        yield m, OPTIMIZERS[name](m.parameters())


@pytest.mark.spec("SD-1")
def test_model_state_dict_equals_torch() -> None:
    model = mlp()
    mine = rsd.get_model_state_dict(model)
    theirs = tsd.get_model_state_dict(model)
    assert list(mine) == [k for k, _ in model.state_dict().items()]
    assert_same(mine, dict(theirs))


@pytest.mark.spec("SD-2")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_dict_equals_torch_after_training(name: str) -> None:
    (m1, o1), (m2, o2) = pair(name)
    data = batches(3)
    assert train(m1, o1, data) == train(m2, o2, data)
    msd, osd = rsd.get_state_dict(m1, o1)
    tmsd, tosd = tsd.get_state_dict(m2, o2)
    assert_same(msd, dict(tmsd))
    assert_same(osd, tosd)
    assert sorted(osd["state"]) == sorted(n for n, _ in m1.named_parameters())
    assert osd["param_groups"][0]["params"] == [n for n, _ in m1.named_parameters()]


@pytest.mark.spec("SD-2", "SD-7")
def test_several_optimizers_with_own_groups() -> None:
    def build() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        m = mlp()
        body = [p for n, p in m.named_parameters() if not n.startswith("4.")]
        head = [p for n, p in m.named_parameters() if n.startswith("4.")]
        return m, [
            torch.optim.Adam([{"params": body[:2], "lr": 0.01}, {"params": body[2:], "lr": 0.002}]),
            torch.optim.SGD(head, lr=0.1, momentum=0.5),
        ]

    m1, opts1 = build()
    m2, opts2 = build()
    data = batches(2)
    for x, y in data:
        for m, opts in ((m1, opts1), (m2, opts2)):
            for o in opts:
                o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            for o in opts:
                o.step()
    _, osd = rsd.get_state_dict(m1, opts1)
    _, tosd = tsd.get_state_dict(m2, opts2)
    assert_same(osd, tosd)
    assert [g["lr"] for g in osd["param_groups"]] == [0.01, 0.002, 0.1]

    # Load into fresh optimizers with other hyperparameters: each gets its own part.
    m3, opts3 = build()
    for o in opts3:
        for g in o.param_groups:
            g["lr"] = 123.0
    rsd.set_state_dict(
        m3, opts3, model_state_dict=rsd.get_model_state_dict(m1), optim_state_dict=osd
    )
    for mine, ref in zip(opts3, opts1):
        assert_same(mine.state_dict(), ref.state_dict())


@pytest.mark.spec("SD-3")
def test_ignore_frozen_params() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    opts = rsd.StateDictOptions(ignore_frozen_params=True)
    mine = rsd.get_model_state_dict(model, options=opts)
    assert "0.weight" not in mine and "0.bias" in mine
    assert_same(mine, dict(tsd.get_model_state_dict(model, options=opts)))


@pytest.mark.spec("SD-4")
def test_empty_state_dicts_raise() -> None:
    with pytest.raises(rsd.StateDictError):
        rsd.get_model_state_dict(nn.ReLU())
    assert rsd.get_model_state_dict(nn.ReLU(), options=rsd.StateDictOptions(strict=False)) == {}
    with pytest.raises(rsd.StateDictError):
        rsd.get_optimizer_state_dict(mlp(), ())


@pytest.mark.spec("SD-5")
def test_set_model_state_dict_reports_keys() -> None:
    src, dst = mlp(), mlp()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    sd = rsd.get_model_state_dict(src)
    sd["extra"] = torch.zeros(1)
    missing = sd.pop("0.bias")
    with pytest.raises(RuntimeError):
        rsd.set_model_state_dict(dst, sd)
    keys = rsd.set_model_state_dict(dst, sd, options=rsd.StateDictOptions(strict=False))
    assert keys.missing_keys == ["0.bias"] and keys.unexpected_keys == ["extra"]
    assert torch.equal(dst[0].weight, src[0].weight)
    assert not torch.equal(dst[0].bias, missing)


@pytest.mark.spec("SD-6")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fresh_optimizer_materialised_like_torch(name: str) -> None:
    (m1, o1), (m2, o2) = pair(name)
    _, osd = rsd.get_state_dict(m1, o1)
    _, tosd = tsd.get_state_dict(m2, o2)
    assert_same(osd, tosd)
    assert len(osd["state"]) == len(list(m1.parameters()))


@pytest.mark.spec("SD-11")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_get_leaves_no_trace(name: str) -> None:
    (m1, o1), (m2, o2) = pair(name)
    before = copy.deepcopy(m1.state_dict())
    rsd.get_state_dict(m1, o1)
    assert len(o1.state) == 0
    assert all(p.grad is None for p in m1.parameters())
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]
    assert_same(dict(m1.state_dict()), dict(before))
    data = batches(3)
    assert train(m1, o1, data) == train(m2, o2, data)


@pytest.mark.spec("SD-11")
def test_torch_materialisation_changes_adam_training() -> None:
    """The documented difference: torch's get_state_dict leaves Adam at step 1."""
    (m1, o1), (m2, o2) = pair("adam")
    tsd.get_state_dict(m1, o1)
    rsd.get_state_dict(m2, o2)
    assert len(o1.state) > 0 and len(o2.state) == 0
    data = batches(2)
    assert train(m1, o1, data) != train(m2, o2, data)


@pytest.mark.spec("SD-7")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_set_state_dict_equals_torch(name: str) -> None:
    (src, so), _ = pair(name)
    train(src, so, batches(3))
    msd, osd = rsd.get_state_dict(src, so)
    (a, ao), (b, bo) = pair(name)
    # Like torch, set_* may alias the given tensors: give each target its own copy.
    rsd.set_state_dict(
        a, ao, model_state_dict=copy.deepcopy(msd), optim_state_dict=copy.deepcopy(osd)
    )
    tsd.set_state_dict(
        b, bo, model_state_dict=copy.deepcopy(msd), optim_state_dict=copy.deepcopy(osd)
    )
    assert_same(ao.state_dict(), bo.state_dict())
    assert_same(dict(a.state_dict()), dict(b.state_dict()))
    data = batches(3, seed=7)
    assert train(a, ao, data) == train(b, bo, data) == train(src, so, data)


@pytest.mark.spec("SD-8")
def test_missing_optimizer_state_is_reported_at_once() -> None:
    (src, so), (dst, do) = pair("adam")
    train(src, so, batches(1))
    _, osd = rsd.get_state_dict(src, so)
    del osd["state"]["0.weight"], osd["state"]["4.bias"]
    with pytest.raises(rsd.StateDictError) as info:
        rsd.set_optimizer_state_dict(dst, do, osd)
    assert "0.weight" in str(info.value) and "4.bias" in str(info.value)
    assert len(do.state) == 0
    rsd.set_optimizer_state_dict(dst, do, osd, options=rsd.StateDictOptions(strict=False))
    loaded = {n for n, p in dst.named_parameters() if p in do.state}
    assert loaded == set(osd["state"])


@pytest.mark.spec("SD-9")
def test_delegation_rules() -> None:
    model = mlp()
    assert not rsd.uses_torch_implementation(model)
    assert not rsd.uses_torch_implementation(
        model, rsd.StateDictOptions(strict=False, ignore_frozen_params=True)
    )
    assert rsd.uses_torch_implementation(model, rsd.StateDictOptions(full_state_dict=True))
    assert rsd.uses_torch_implementation(model, submodules={model[0]})
    wrapped = nn.Sequential(model)
    wrapped._fqn_modifiers = lambda: {}  # type: ignore[assignment]
    assert rsd.uses_torch_implementation(wrapped)


@pytest.mark.spec("SD-9")
def test_delegated_call_reaches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = tsd.get_optimizer_state_dict

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("optim")
        return real(*args, **kwargs)

    monkeypatch.setattr(tsd, "get_optimizer_state_dict", spy)
    (m, o), _ = pair("sgd_momentum")
    opts = rsd.StateDictOptions(flatten_optimizer_state_dict=True)
    flat = rsd.get_optimizer_state_dict(m, o, options=opts)
    assert calls == ["optim"]
    assert "state.0.weight.momentum_buffer" in flat


def _storage(kind: str, path: Path) -> dict[str, Any]:
    """Where dcp.save/load put the checkpoint: torch's default storage or refdcp's."""
    if kind == "torch":
        return {"save": {"checkpoint_id": path}, "load": {"checkpoint_id": path}}
    from refdcp.storage.fs.filesystem import FileSystemReader, FileSystemWriter

    return {
        "save": {"storage_writer": FileSystemWriter(path)},
        "load": {"storage_reader": FileSystemReader(path)},
    }


def _save_load_resume(name: str, tmp_path: Path, kind: str, api: Any = dcp) -> None:
    """Train, save an AppState through ``api`` (torch's dcp, refdcp or its reference), load it
    into a fresh model and optimizer, train on: the same losses as training straight through."""
    data = batches(6)
    (ref, ro), (m, o) = pair(name)
    expected = train(ref, ro, data)
    first = train(m, o, data[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        where = _storage(kind, tmp_path)
        api.save({"app": AppState(m, o)}, no_dist=True, **where["save"])
        (fresh, fo), _ = pair(name)
        target = AppState(fresh, fo)
        assert set(target.state_dict()) == {"model", "optim"}
        api.load({"app": target}, no_dist=True, **where["load"])
    assert first + train(fresh, fo, data[3:]) == expected


@pytest.mark.spec("SD-10", "SD-7")
@pytest.mark.parametrize("kind", ["torch", "refdcp_storage"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_app_state_round_trip_resumes_training(name: str, kind: str, tmp_path: Path) -> None:
    _save_load_resume(name, tmp_path, kind)


@pytest.mark.spec("SD-10", "SD-7", "REF-6")
@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_app_state_round_trip_through_either_implementation_resumes_training(
    name: str, tmp_path: Path, impl: ModuleType
) -> None:
    """The Stateful AppState through ``refdcp`` and ``refdcp.reference`` (API-2)."""
    _save_load_resume(name, tmp_path, "torch", api=impl)


@pytest.mark.spec("SD-10")
def test_app_state_model_only(tmp_path: Path) -> None:
    src, dst = mlp(), nn.Sequential(*(copy.deepcopy(mlp())))
    with torch.no_grad():
        for p in src.parameters():
            p.mul_(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"app": AppState(src)}, checkpoint_id=tmp_path, no_dist=True)
        dcp.load({"app": AppState(dst)}, checkpoint_id=tmp_path, no_dist=True)
    assert_same(dict(dst.state_dict()), dict(src.state_dict()))
