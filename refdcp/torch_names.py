"""torch's public DCP names and module paths under ``refdcp`` (API-27).

Code written as ``import torch.distributed.checkpoint as dcp`` switches by
changing that one import to ``import refdcp as dcp``: every public name of
``torch.distributed.checkpoint`` 2.13 and of its public submodules
(``dcp.state_dict_saver.save``, ``dcp.metadata.Metadata``, ...) resolves under
``refdcp`` with the same meaning. :data:`SUBMODULES` says where each name
comes from:

* ``"refdcp"``-prefixed paths: refdcp's own implementation (``save``, the
  planners, the file-system storage, the state-dict helpers);
* :data:`TORCH`: torch's own object, because refdcp uses it as it is (the data
  types and ABCs of the protocol, API-3) or accepts torch's component in its
  place (the Hugging Face storage, torch's stagers, ``format_utils``);
* :class:`Absent`: a name refdcp does not provide; using it raises
  :class:`NotProvidedError` saying what to use instead.

The submodules are served by a finder (:func:`install`) that builds
``refdcp.<name>`` on import; refdcp's own ``api``, ``staging`` and ``storage``
packages carry torch's names of those modules themselves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from refdcp.errors import NotProvidedError

__all__ = [
    "Absent",
    "NotProvidedError",
    "OWN_MODULES",
    "SUBMODULES",
    "TOP_LEVEL",
    "TORCH",
    "WHOLE",
    "install",
    "resolve",
]

TORCH_PKG = "torch.distributed.checkpoint"


@dataclass(frozen=True)
class Absent:
    """A torch name refdcp does not provide, and what to use instead (API-27)."""

    instead: str


#: The name is torch's own object (same module path under torch).
TORCH = "torch"

_SAVE_INSTEAD = Absent("refdcp.save (torch deprecates save_state_dict for it)")
_LOAD_INSTEAD = Absent("refdcp.load (torch deprecates load_state_dict for it)")
_STATE_DICT = "refdcp.state.state_dict"

#: torch submodule -> {public name: refdcp path "module:attr", TORCH, or Absent}.
SUBMODULES: dict[str, dict[str, str | Absent]] = {
    "state_dict_saver": {
        "save": "refdcp.api:save",
        "async_save": "refdcp.asyncsave.save:async_save",
        "save_state_dict": _SAVE_INSTEAD,
        "AsyncCheckpointerType": TORCH,
        "AsyncSaveResponse": TORCH,
    },
    "state_dict_loader": {"load": "refdcp.api:load", "load_state_dict": _LOAD_INSTEAD},
    "filesystem": {
        "FileSystemWriter": "refdcp.storage:FileSystemWriter",
        "FileSystemReader": "refdcp.storage:FileSystemReader",
        "FileSystem": TORCH,
        "FileSystemBase": TORCH,
        "SerializationFormat": TORCH,
    },
    "default_planner": {
        "DefaultSavePlanner": "refdcp.planning:DefaultSavePlanner",
        "DefaultLoadPlanner": "refdcp.planning:DefaultLoadPlanner",
        "create_default_local_load_plan": TORCH,
        "create_default_global_load_plan": TORCH,
        "create_default_local_save_plan": TORCH,
        "create_default_global_save_plan": TORCH,
    },
    "state_dict": {
        "get_model_state_dict": f"{_STATE_DICT}:get_model_state_dict",
        "get_optimizer_state_dict": f"{_STATE_DICT}:get_optimizer_state_dict",
        "get_state_dict": f"{_STATE_DICT}:get_state_dict",
        "set_model_state_dict": f"{_STATE_DICT}:set_model_state_dict",
        "set_optimizer_state_dict": f"{_STATE_DICT}:set_optimizer_state_dict",
        "set_state_dict": f"{_STATE_DICT}:set_state_dict",
        **{
            n: TORCH
            for n in (
                "FQNS_T",
                "PrimitiveType",
                "ValueType",
                "DictValueType",
                "ListDictValueType",
                "OptimizerStateType",
                "StateDictOptions",
            )
        },
    },
    **{
        module: {n: TORCH for n in names}
        for module, names in {
            "metadata": (
                "ChunkStorageMetadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "Metadata",
                "MetadataIndex",
                "TensorProperties",
                "StorageMeta",
            ),
            "planner": (
                "WriteItemType",
                "LoadItemType",
                "BytesIOWriteData",
                "TensorWriteData",
                "WriteItem",
                "ReadItem",
                "SavePlan",
                "LoadPlan",
                "SavePlanner",
                "LoadPlanner",
            ),
            "stateful": ("Stateful", "StatefulT"),
            "hf_storage": ("HuggingFaceStorageWriter", "HuggingFaceStorageReader"),
            "quantized_hf_storage": ("QuantizedHuggingFaceStorageReader",),
            "format_utils": (
                "dcp_to_torch_save",
                "torch_save_to_dcp",
                "BroadcastingTorchSaveReader",
                "DynamicMetaLoadPlanner",
            ),
            "optimizer": ("load_sharded_optimizer_state_dict",),
            "planner_helpers": ("create_read_items_for_chunk_list",),
            "utils": ("find_tensor_shard", "find_state_dict_object"),
        }.items()
    },
}

#: torch submodules with no ``__all__`` of their own: ``refdcp.<name>`` is torch's module.
WHOLE = ("logger", "logging_handlers", "resharding")

#: torch submodule names that are refdcp packages of its own, carrying torch's names too.
OWN_MODULES = {
    "api": ("CheckpointException",),
    "staging": ("AsyncStager", "BlockingAsyncStager", "DefaultStager", "StagingOptions"),
    "storage": ("WriteResult", "StorageWriter", "StorageReader"),
}

#: torch's top-level names that ``refdcp`` itself does not define: where each comes from.
TOP_LEVEL: dict[str, str | Absent] = {
    "CheckpointException": TORCH,
    "save_state_dict": _SAVE_INSTEAD,
    "load_state_dict": _LOAD_INSTEAD,
    "load_sharded_optimizer_state_dict": TORCH,
    **{
        n: TORCH
        for n in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "HuggingFaceStorageReader",
            "HuggingFaceStorageWriter",
            "LoadPlan",
            "LoadPlanner",
            "Metadata",
            "QuantizedHuggingFaceStorageReader",
            "ReadItem",
            "SavePlan",
            "SavePlanner",
            "StorageReader",
            "StorageWriter",
            "TensorStorageMetadata",
            "WriteItem",
        )
    },
}


def _torch_home(module: str) -> str:
    """The torch module whose names ``refdcp.<module>`` carries ("" is the top level)."""
    return f"{TORCH_PKG}.{module}" if module else TORCH_PKG


def resolve(module: str, name: str, table: dict[str, str | Absent]) -> Any:
    """The object ``refdcp.<module>.<name>`` stands for (API-27); ``module`` "" is the top level."""
    where = table.get(name)
    if where is None:
        path = f"refdcp.{module}" if module else "refdcp"
        raise AttributeError(f"module {path!r} has no attribute {name!r}")
    if isinstance(where, Absent):
        path = f"refdcp.{module}.{name}" if module else f"refdcp.{name}"
        raise NotProvidedError(f"{path} is not provided by refdcp: use {where.instead}")
    if where == TORCH:
        return getattr(importlib.import_module(_torch_home(module)), name)
    target, _, attr = where.partition(":")
    return getattr(importlib.import_module(target), attr)


def _make_module(fullname: str, sub: str) -> types.ModuleType:
    if sub in WHOLE:
        whole = importlib.import_module(f"{TORCH_PKG}.{sub}")
        table: dict[str, str | Absent] = {n: TORCH for n in dir(whole) if not n.startswith("__")}
    else:
        table = SUBMODULES[sub]
    mod = types.ModuleType(fullname, f"torch's {TORCH_PKG}.{sub} names under refdcp (API-27).")
    mod.__all__ = [n for n, w in table.items() if not isinstance(w, Absent)]  # type: ignore[attr-defined]

    def __getattr__(name: str) -> Any:
        value = resolve(sub, name, table)
        setattr(mod, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(mod.__all__)

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    mod.__dir__ = __dir__  # type: ignore[method-assign]
    return mod


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``refdcp.<torch submodule>`` for the names in :data:`SUBMODULES` and :data:`WHOLE`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        pkg, _, sub = fullname.partition(".")
        if pkg != "refdcp" or (sub not in SUBMODULES and sub not in WHOLE):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _make_module(spec.name, spec.name.partition(".")[2])

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_FINDER = _Finder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (API-27)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
