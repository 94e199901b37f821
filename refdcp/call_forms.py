"""torch's older call forms of ``save`` and ``load``, accepted with a warning (API-22).

torch 2.13's ``dcp.save`` and ``dcp.load`` take one positional parameter,
``state_dict``, and everything else by keyword; but a call with exactly two
positional arguments is still accepted: the second one is taken as the
storage object (``storage_writer`` for ``save``, ``storage_reader`` for
``load``) and a ``UserWarning`` says that the order of the arguments has
changed. ``async_save`` never had that form, so it is not wrapped.

:func:`storage_positional` gives refdcp's entry points the same call forms.
The wrapped function keeps its own signature (``inspect.signature`` follows
``__wrapped__``), so the signature checks of API-10 see torch's parameters.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["storage_positional"]

P = ParamSpec("P")
R = TypeVar("R")


def storage_positional(keyword: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Map ``fn(state_dict, storage)`` to ``fn(state_dict, **{keyword: storage})``, warning.

    Any other number of positional arguments goes to ``fn`` unchanged (so a
    third one is a ``TypeError``, as with torch). Passing the storage both
    positionally and as ``keyword=`` is a ``TypeError`` naming the keyword.
    """

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        name = fn.__name__

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) != 2:
                return fn(*args, **kwargs)
            if keyword in kwargs:
                raise TypeError(f"{name}() got multiple values for argument {keyword!r}")
            warnings.warn(
                f"{name}(state_dict, {keyword}): the argument order of {name} has changed; "
                f"the second positional argument is taken as {keyword}=, pass it by keyword "
                "(torch 2.13 gives the same warning for this call form)",
                UserWarning,
                stacklevel=2,
            )
            kwargs[keyword] = args[1]
            return fn(args[0], **kwargs)

        return call

    return wrap
