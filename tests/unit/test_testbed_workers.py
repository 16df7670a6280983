"""Testbed names per pytest-xdist worker (tests/testbed worker_prefix, worker_net): gw0 and a run without
xdist keep the names, every other worker gets names and a /24 of its own."""

from __future__ import annotations

import pytest

from tests.testbed import Testbed, worker_net, worker_prefix


@pytest.mark.parametrize("worker", [None, "gw0"])
def test_the_first_worker_and_a_plain_run_keep_the_names(monkeypatch, worker):
    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert (worker_prefix("tb"), worker_net("10.213.50")) == ("tb", "10.213.50")


def test_every_other_worker_gets_its_own_prefix_and_net(monkeypatch):
    seen = set()
    for k in range(1, 12):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        tb = Testbed(prefix=worker_prefix("tbdown"), net=worker_net("10.213.50"))  # validates both
        seen.add((tb.prefix, tb.net, tb.bridge))
        # a digit never follows the prefix: `down` of prefix tb deletes the links v/t/d tb<digits>
        assert not tb.prefix[len("tbdown")].isdigit()
    assert len({s[0] for s in seen}) == len({s[1] for s in seen}) == len({s[2] for s in seen}) == 11
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert (worker_prefix("tb"), worker_net("10.213.50")) == ("tbw3", "10.216.50")
