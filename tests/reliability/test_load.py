"""Load: 8 testbed hosts x 1 process start and finish a short run together; the wall time is recorded.

8 hosts is the issue's target and fits 2 cores: each host runs one torchrun agent and one worker
(16 torch processes importing at once, plus the preflight probe on every host), gloo over the
testbed bridge, a tiny MLP for a few steps. The time from `ddp-launch` to its exit, preflight
included, is printed, attached to the JUnit report (record_property) and written to
logs/<job>/load.json. RL_LOAD_HOSTS changes the host count.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.test_launch_testbed import assert_nothing_left, launch, make_inventory
from tests.reliability.support import finals, job_id, private_testbed
from tests.testbed import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

HOSTS = int(os.environ.get("RL_LOAD_HOSTS", "8"))
STEPS = 10


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    # Every host imports torch in its own probe, as on a first launch on real nodes.
    with private_testbed("rlld", "10.213.91", HOSTS, shared_probe_cache=False) as bed:
        yield bed


def test_eight_hosts_start_and_finish_a_short_run(tb: Testbed, tmp_path: Path, record_property) -> None:  # noqa: ANN001
    job = job_id("load")
    inv = make_inventory(tb, tmp_path)
    t0 = time.monotonic()
    code, out = launch(
        ["--hosts", str(inv), "--job-id", job, "--set", f"train.max_steps={STEPS}",
         "--set", "train.batch_size=8", "--set", "checkpoint.interval_steps=0"],
        tmp_path, timeout=600,
    )  # fmt: skip
    wall = time.monotonic() - t0
    assert code == 0, out
    assert f"preflight ok on {HOSTS} nodes" in out
    got = finals(out.splitlines())
    assert sorted((host, int(rank), int(world), int(step)) for host, _, rank, world, step, _ in got) == [
        (f"node{i}", i, HOSTS, STEPS) for i in range(HOSTS)
    ], out
    assert len({sha for *_, sha in got}) == 1, "ranks ended with different parameters"
    logs = tmp_path / "logs" / job
    for i in range(HOSTS):
        assert re.search(r"ddp-train: final rank=", (logs / f"node{i}.log").read_text()), f"node{i}"
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["exit_code"] == 0 and len(summary["nodes"]) == HOSTS
    assert_nothing_left(tb, job)
    record = {"hosts": HOSTS, "procs_per_host": 1, "steps": STEPS, "wall_s": round(wall, 1),
              "launcher_elapsed_s": summary["elapsed_s"], "cpus": os.cpu_count()}  # fmt: skip
    (logs / "load.json").write_text(json.dumps(record, indent=2) + "\n")
    record_property("load_wall_s", record["wall_s"])
    print(f"load: {HOSTS} hosts x 1 process, {STEPS} steps: {wall:.1f}s wall, {summary['elapsed_s']}s in job")
