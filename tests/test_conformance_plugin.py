"""The pytest entry point of the conformance suite (CONF-44)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from conformance.examples.dict_backend import DictBackend
from conformance.plugin import ConformanceWarning, conformance_tests

pytestmark = pytest.mark.timeout(120)

test_example_backend_conformance = conformance_tests(
    "conformance.examples.dict_backend:backend", examples=2
)


@pytest.mark.spec("CONF-44")
def test_plugin_fails_on_a_failed_must_and_skips_not_applicable() -> None:
    from tests.test_conformance_broken import DropsItemWriter

    @dataclasses.dataclass
    class Dropping(DictBackend):
        def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> Any:
            return DropsItemWriter(self.store, location)

    fn = conformance_tests(Dropping, examples=1)
    with pytest.raises(pytest.fail.Exception, match="CONF-8"):
        fn("CONF-8")
    backend = Dropping()
    backend.capabilities = dataclasses.replace(backend.capabilities, thread_count=False)
    with pytest.raises(pytest.skip.Exception, match="thread_count"):
        conformance_tests(backend, examples=1)("CONF-19")


@pytest.mark.spec("CONF-44", "CONF-42")
def test_plugin_warns_on_a_failed_should() -> None:
    from tests.test_conformance_broken import InPlaceWriter

    @dataclasses.dataclass
    class InPlace(DictBackend):
        def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> Any:
            return InPlaceWriter(self.store, location)

    backend = InPlace()
    backend.capabilities = dataclasses.replace(backend.capabilities, atomic_overwrite=False)
    fn = conformance_tests(backend, examples=1)
    with pytest.warns(ConformanceWarning, match="CONF-25"):
        fn("CONF-25")
