"""Fixtures shared by the reliability tests."""

from __future__ import annotations

import pytest

from tests.integration.trainrun import describe, parse_finals, run_torchrun, sets
from tests.reliability.support import TRAIN_30


@pytest.fixture(scope="session")
def reference_sha(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of an uninterrupted TRAIN_30 run on 2 ranks (torchrun, gloo, CPU, same seed)."""
    work = tmp_path_factory.mktemp("reference")
    proc = run_torchrun([*TRAIN_30, *sets(run__dir=str(work / "runs"))], cwd=work)
    assert proc.returncode == 0, describe(proc)
    return parse_finals(proc.stdout).sha
