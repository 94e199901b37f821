"""One exception hierarchy, drawn in refdcp/errors.py and importable from its old places (ERR-6, ERR-7)."""

from __future__ import annotations

import pickle
from types import ModuleType

import pytest

import refdcp
import refdcp.errors as errors
from refdcp.comm.fake import CollectiveMismatch as FakeCollectiveMismatch
from refdcp.comm.fake import RankFailures
from refdcp.driver.simulator import Deadlock
from refdcp.planning.dedup.deferred import ReplicaMismatchError
from refdcp.planning.load_policy import LoadPolicyError
from refdcp.planning.metadata.build import PlanValidationError
from refdcp.staging.buffer_pool import StagingTimeoutError
from refdcp.state.state_dict import StateDictError
from refdcp.storage import errors as storage_errors
from refdcp.storage.format.items import MissingChecksumError as ItemsMissingChecksumError

OWN = [
    errors.ProtocolError,
    errors.ProblemsError,
    errors.CommError,
    errors.CommTimeout,
    errors.CommAborted,
    errors.CollectiveMismatch,
    RankFailures,
    Deadlock,
    StagingTimeoutError,
    StateDictError,
    PlanValidationError,
    ReplicaMismatchError,
    LoadPolicyError,
    storage_errors.CorruptionError,
    storage_errors.MissingChecksumError,
    storage_errors.UnsafeMetadataError,
    storage_errors.FormatVersionError,
    storage_errors.CheckpointExistsError,
]


@pytest.mark.spec("ERR-6")
@pytest.mark.parametrize("cls", OWN, ids=lambda c: c.__name__)
def test_every_refdcp_error_derives_from_the_base_and_is_drawn(cls: type) -> None:
    assert issubclass(cls, errors.RefdcpError)
    assert f" {cls.__name__} " in (errors.__doc__ or "").replace("\n", " ")


@pytest.mark.spec("ERR-6")
def test_old_import_locations_are_the_same_classes() -> None:
    assert FakeCollectiveMismatch is errors.CollectiveMismatch
    assert ItemsMissingChecksumError is storage_errors.MissingChecksumError
    import refdcp.comm
    import refdcp.storage

    assert refdcp.comm.CollectiveMismatch is errors.CollectiveMismatch
    assert refdcp.storage.MissingChecksumError is storage_errors.MissingChecksumError
    assert not issubclass(errors.CheckpointError, errors.RefdcpError)


@pytest.mark.spec("ERR-7")
def test_problems_error_is_a_refdcp_error_and_a_value_error() -> None:
    err = PlanValidationError(["a", "b"])
    assert isinstance(err, errors.RefdcpError) and isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is PlanValidationError and back.problems == ["a", "b"]


@pytest.mark.spec("ERR-6", "REF-1")
def test_both_implementations_export_the_same_error_classes(impl: ModuleType) -> None:
    """A caller catches the same classes whichever implementation it imports (one hierarchy)."""
    exported = [
        n
        for n in refdcp.__all__
        if isinstance(getattr(refdcp, n), type) and issubclass(getattr(refdcp, n), BaseException)
    ]
    assert {"CheckpointError", "RefdcpError", "CorruptionError"} <= set(exported)
    missing = [n for n in exported if getattr(impl, n, None) is not getattr(refdcp, n)]
    assert missing == [], f"{impl.__name__} does not re-export {missing}"
