"""``refdcp trace --reference``: the readable planners give the very same trace (TRACE-14)."""

from __future__ import annotations

import io

import pytest

from refdcp.tools.trace import run_trace, trace_command


@pytest.mark.spec("TRACE-14", "REF-3")
@pytest.mark.parametrize("sharding", ["rows", "cols", "replicated"])
@pytest.mark.parametrize(("save", "load"), [(4, 2), (3, 3), (1, 4)])
def test_the_reference_planners_print_the_same_trace(sharding: str, save: int, load: int) -> None:
    outs = {}
    for reference in (False, True):
        out = io.StringIO()
        assert (
            trace_command(
                save_world=save, load_world=load, sharding=sharding, out=out, reference=reference
            )
            == 0
        )
        outs[reference] = out.getvalue()
    # the same lines; the metadata's keys may be listed in another order (TRACE-14)
    assert sorted(outs[True].splitlines()) == sorted(outs[False].splitlines())
    assert run_trace(save, load, sharding, reference=True).verified
