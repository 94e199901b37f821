"""The bounded unpickler's temporary classes, and the way back to the real DCP class (FMT-11).

``safe.py`` builds each DCP class of ``.metadata`` as a subclass marked with
:data:`BASE_ATTR`; ``shape.py`` turns each object it checks back into its DCP
class with :func:`restore_dcp_class`. Both import this module, so neither
imports the other for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BASE_ATTR", "restore_dcp_class"]

#: Attribute marking refdcp's temporary subclasses of the DCP classes (see ``restore_dcp_class``).
BASE_ATTR = "_refdcp_metadata_base"


def restore_dcp_class(obj: Any) -> Any:
    """Give an object made by the bounded unpickler its real DCP class back (FMT-11)."""
    base = getattr(type(obj), BASE_ATTR, None)
    if base is not None:
        object.__setattr__(obj, "__class__", base)
    return obj
