"""The preflight probe caches a node's torch facts (importing torch costs seconds per node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddp_train.launch.node import script
from ddp_train.launch.node.probe import PROBE_MARK


def _probe(home, **env):
    venv = os.path.dirname(os.path.dirname(sys.executable))
    res = subprocess.run(
        [sys.executable, "-c", script("probe"), venv, ""],
        env={**os.environ, "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(PROBE_MARK))
    return json.loads(line[len(PROBE_MARK) :])


@pytest.mark.slow
def test_second_probe_reads_the_cache_and_agrees(tmp_path):
    import torch

    first = _probe(tmp_path)
    assert first["torch"] == torch.__version__ and "torch_cached" not in first
    second = _probe(tmp_path)
    assert second["torch_cached"] is True
    assert {k: second.get(k) for k in ("torch", "cuda", "gpus")} == {
        k: first.get(k) for k in ("torch", "cuda", "gpus")
    }


@pytest.mark.slow
def test_cache_is_keyed_by_env_and_can_be_bypassed(tmp_path):
    _probe(tmp_path)
    assert "torch_cached" not in _probe(tmp_path, PYTHONPATH=str(tmp_path))  # another key
    assert "torch_cached" not in _probe(tmp_path, DDP_LAUNCH_PROBE_CACHE="0")
