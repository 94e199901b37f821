"""Old module paths that still import (API-8): each name maps to the module that replaced it.

refdcp's round-2 layout grouped the top level into packages (``asyncsave``,
``state``, ``tools``); code written against the first layout keeps working
because importing an old path returns the new module itself (one object, not
a copy), loaded only when first asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

#: old dotted path -> new dotted path
MOVED: dict[str, str] = {
    "refdcp.async_save": "refdcp.asyncsave.save",
    "refdcp.checkpointer": "refdcp.asyncsave.checkpointer",
    "refdcp.staging.process_executor": "refdcp.asyncsave.process_executor",
    "refdcp.app_state": "refdcp.state.app_state",
    "refdcp.state_dict": "refdcp.state.state_dict",
    "refdcp.storage_select": "refdcp.storage.select",
    "refdcp.cli": "refdcp.tools.cli",
    "refdcp.cli_verify": "refdcp.tools.verify",
    "refdcp.inspect_cmd": "refdcp.tools.inspect",
    "refdcp.trace": "refdcp.tools.trace",
    "refdcp.progress": "refdcp.tools.progress",
    "refdcp.spec_report": "refdcp.tools.spec_report",
    "refdcp.protocol.diagrams": "refdcp.tools.diagrams",
}


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported target; keeps the target's own ``__spec__``/``__loader__``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own: tuple[object, object] | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Undo the import system's rewrite of the module's spec and loader."""
        if self._own is not None:
            module.__spec__, module.__loader__ = self._own  # type: ignore[assignment]


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves an old path in :data:`MOVED` to its new module."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once.

    ``refdcp.async_save`` is both the public function and an old module path:
    the module is aliased eagerly so that importing the path never rebinds the
    package attribute (the function).
    """
    sys.modules.setdefault("refdcp.async_save", importlib.import_module(MOVED["refdcp.async_save"]))
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
