"""Every spec requirement is cited by a test, and every citation names a real requirement."""

from __future__ import annotations

import pytest

from refdcp.tools.spec_report import _ID, load_spec, repo_root, trace


def test_spec_parses_and_ids_are_unique() -> None:
    reqs, dups = load_spec(repo_root() / "spec")
    assert reqs, "spec/ holds no requirement"
    assert not dups, f"duplicate requirement IDs: {dups}"
    assert all(_ID.match(r) for r in reqs)


def test_every_requirement_has_a_test() -> None:
    t = trace()
    assert not t.untested, f"requirements without a test: {t.untested}"


def test_every_citation_names_a_known_requirement() -> None:
    t = trace()
    bad = [f"{c.id} ({c.file}:{c.line})" for c in t.unknown]
    assert not bad, f"tests cite unknown requirement IDs: {bad}"


def test_collected_spec_markers_are_known(request: pytest.FixtureRequest) -> None:
    """The runtime marker check in conftest agrees with the static scan."""
    t = trace()
    for item in request.session.items:
        for mark in item.iter_markers("spec"):
            for rid in mark.args:
                assert rid in t.requirements, f"{item.nodeid} cites unknown {rid}"
