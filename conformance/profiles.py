"""Profiles: the capabilities a storage format allows, with the reasons (CONF-69).

A backend built on a format that cannot hold everything DCP saves declares the
format's profile, so the checks the format rules out report not applicable with
the format's reason while every other check runs::

    capabilities = dataclasses.replace(profiles.SAFETENSORS, thread_count=True)

``refdcp conformance TARGET --profile safetensors`` lays a profile over the
backend's own declaration instead (:func:`overlay`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conformance.backend import Backend, Capabilities

__all__ = ["FULL", "PROFILES", "SAFETENSORS", "Profiled", "overlay", "safetensors_dtypes"]


def safetensors_dtypes() -> tuple[str, ...]:
    """The dtypes the safetensors format names (the same table ``refdcp convert`` uses)."""
    from refdcp.tools.convert import SAFETENSORS_DTYPES

    return tuple(sorted(str(dt).replace("torch.", "") for dt in SAFETENSORS_DTYPES))


#: No restriction: what a backend declares with ``Capabilities()``.
FULL = Capabilities()

#: A backend whose files are safetensors (torch's ``HuggingFaceStorageWriter``):
#: tensors only, of the dtypes safetensors names.
SAFETENSORS = Capabilities(
    bytes_items=False,
    dtypes=safetensors_dtypes(),
    why=(
        (
            "bytes_items",
            "safetensors profile: a .safetensors file holds tensors only, so a bytes "
            "item (BytesIO, pickled object) has nowhere to go",
        ),
        (
            "dtypes",
            "safetensors profile: the safetensors format has no name for this dtype",
        ),
    ),
)

PROFILES: dict[str, Capabilities] = {"full": FULL, "safetensors": SAFETENSORS}


def overlay(own: Capabilities, profile: Capabilities) -> Capabilities:
    """``own`` restricted by ``profile``: each capability the profile gives a reason for
    is dropped, the dtypes are those both store, and the profile's reasons are kept."""
    ruled_out = {
        name: False for name, _ in profile.why if isinstance(getattr(own, name, None), bool)
    }
    if own.dtypes is None or profile.dtypes is None:
        dtypes = own.dtypes if profile.dtypes is None else profile.dtypes
    else:
        dtypes = tuple(d for d in own.dtypes if d in profile.dtypes)
    why = tuple((dict(own.why) | dict(profile.why)).items())
    return dataclasses.replace(own, **ruled_out, dtypes=dtypes, why=why)


@dataclasses.dataclass
class Profiled:
    """``backend`` run under a profile: its capabilities overlaid, everything else its own."""

    backend: Backend
    profile_name: str

    @property
    def name(self) -> str:
        return f"{self.backend.name} [profile {self.profile_name}]"

    @property
    def capabilities(self) -> Capabilities:
        return overlay(self.backend.capabilities, PROFILES[self.profile_name])

    def new_location(self, scratch: Any) -> Any:
        return self.backend.new_location(scratch)

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> Any:
        return self.backend.writer(location, rank=rank, thread_count=thread_count)

    def reader(self, location: Any) -> Any:
        return self.backend.reader(location)
