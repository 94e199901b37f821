"""Conformance profiles: what a storage format rules out, with the reasons (CONF-69)."""

from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.backend import Capabilities
from conformance.backends import RefdcpFileSystem, torch_hf
from conformance.cli import conformance_command
from conformance.profiles import PROFILES, SAFETENSORS, Profiled, overlay
from conformance.runner import run_checks
from conformance.truth import DTYPES
from refdcp.tools.convert import SAFETENSORS_DTYPES

pytest.importorskip("safetensors")

FLAGS = [f.name for f in dataclasses.fields(Capabilities) if f.type in ("bool", bool)]
NAMES = [str(d).replace("torch.", "") for d in DTYPES]


@pytest.mark.spec("CONF-69")
def test_safetensors_profile_rules_out_bytes_and_unnamed_dtypes_only() -> None:
    assert set(SAFETENSORS.dtypes or ()) == {
        str(d).replace("torch.", "") for d in SAFETENSORS_DTYPES
    }
    assert {name for name, _ in SAFETENSORS.why} == {"bytes_items", "dtypes"}
    assert not SAFETENSORS.bytes_items
    assert PROFILES["full"] == Capabilities()


@pytest.mark.spec("CONF-69")
@given(
    own=st.fixed_dictionaries({f: st.booleans() for f in FLAGS}),
    own_dtypes=st.none() | st.lists(st.sampled_from(NAMES), unique=True).map(tuple),
    ruled=st.lists(st.sampled_from(FLAGS), unique=True),
    prof_dtypes=st.none() | st.lists(st.sampled_from(NAMES), unique=True).map(tuple),
)
def test_overlay_drops_only_what_the_profile_gives_a_reason_for(
    own: dict[str, bool],
    own_dtypes: tuple[str, ...] | None,
    ruled: list[str],
    prof_dtypes: tuple[str, ...] | None,
) -> None:
    mine = Capabilities(**own, dtypes=own_dtypes)
    profile = Capabilities(dtypes=prof_dtypes, why=tuple((f, f"no {f}") for f in ruled))
    got = overlay(mine, profile)
    for f in FLAGS:
        assert getattr(got, f) == (own[f] and f not in ruled), f
        if f in ruled:
            assert got.reason(f) == f"no {f}"
    if own_dtypes is None or prof_dtypes is None:
        assert got.dtypes == (own_dtypes if prof_dtypes is None else prof_dtypes)
    else:
        assert set(got.dtypes or ()) == set(own_dtypes) & set(prof_dtypes)


@pytest.mark.spec("CONF-69")
@pytest.mark.slow  # long; make test-thorough runs it
def test_torch_hf_under_the_profile_runs_every_check_but_the_ruled_out_ones() -> None:
    """Only CONF-13 turns n/a by the profile (with its reason); CONF-10 runs the dtypes
    safetensors names and says which it left out; the other n/a results are the ones the
    same backend gets without the profile's limits."""
    backend = torch_hf()
    with_profile = {r.id: r for r in run_checks(backend, examples=3)}
    plain = dataclasses.replace(backend, capabilities=Capabilities(thread_count=True))
    without = {r.id: r for r in run_checks(plain, examples=3)}
    assert with_profile["CONF-13"].status == "n/a"
    assert "holds tensors only" in with_profile["CONF-13"].reason
    assert with_profile["CONF-10"].status == "pass"
    assert "complex128 not saved" in with_profile["CONF-10"].reason
    assert "no name for this dtype" in with_profile["CONF-10"].reason
    assert without["CONF-10"].status == "fail" and without["CONF-13"].status == "fail"
    na = {i for i, r in with_profile.items() if r.status == "n/a"}
    assert na - {"CONF-13"} == {i for i, r in without.items() if r.status == "n/a"}


@pytest.mark.spec("CONF-69")
def test_profile_option_lays_the_profile_over_a_full_backend(tmp_path: Path) -> None:
    out = io.StringIO()
    report = tmp_path / "r.json"
    with redirect_stdout(out):
        code = conformance_command(
            "conformance.backends:refdcp_fs",
            json_path=str(report),
            only=["CONF-10", "CONF-13"],
            profile="safetensors",
        )
    assert code == 0
    doc = json.loads(report.read_text())
    assert doc["backend"].endswith("[profile safetensors]")
    got = {r["id"]: r for r in doc["results"]}
    assert got["CONF-13"]["status"] == "n/a" and "safetensors profile" in got["CONF-13"]["reason"]
    assert got["CONF-10"]["status"] == "pass" and "complex128" in got["CONF-10"]["reason"]
    # the backend's own declarations the profile has no reason for are kept
    caps = Profiled(RefdcpFileSystem(), "safetensors").capabilities
    assert caps.atomic_overwrite and caps.thread_count and not caps.bytes_items
    with pytest.raises(ValueError, match="unknown profile"):
        run_checks(RefdcpFileSystem(), only=["CONF-10"], profile="nosuch")


@pytest.mark.spec("CONF-69")
def test_a_backend_storing_none_of_the_dtypes_gets_na() -> None:
    backend = dataclasses.replace(
        RefdcpFileSystem(), capabilities=Capabilities(dtypes=(), why=(("dtypes", "x"),))
    )
    (result,) = run_checks(backend, only=["CONF-10"])
    assert result.status == "n/a" and "none of the dtypes" in result.reason


@pytest.mark.spec("CONF-69")
def test_both_command_lines_offer_every_profile() -> None:
    import argparse

    from conformance.cli import add_arguments
    from refdcp.tools.cli import _parser

    args = _parser().parse_args(["conformance", "m:b", "--profile", "safetensors"])
    assert args.profile == "safetensors"
    p = argparse.ArgumentParser()
    add_arguments(p)
    seen = 0
    for action in [
        *p._actions,
        *_parser()._subparsers._group_actions[0].choices["conformance"]._actions,
    ]:  # type: ignore[union-attr]
        if "--profile" in action.option_strings:
            assert sorted(action.choices or ()) == sorted(PROFILES)
            seen += 1
    assert seen == 2
