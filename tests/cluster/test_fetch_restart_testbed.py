"""`ddp-launch fetch` and `restart` after a short packaged-trainer job on the session's testbed (issue 30
items 4, 5): each host has its own ddp_workdir, so best.pt, the checkpoints and metrics.jsonl exist only
on rank 0's node, and fetch brings them here, hash-checked. restart reruns the recorded command (its
--fresh and --job-id dropped, a masked --env taken from this shell) and resumes at the recorded step.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from tests.cluster.test_launch_testbed import Launcher, launch, make_inventory
from tests.testbed import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_then_restart(testbed: Testbed, tmp_path: Path) -> None:
    work = {f"node{i}": tmp_path / f"work {i}" for i in range(3)}
    for w in work.values():
        w.mkdir()
    inv = make_inventory(testbed, tmp_path, host_vars={h: {"ddp_workdir": str(w)} for h, w in work.items()})
    args = ["--hosts", str(inv), "--job-id", "fr1", "--fresh", "--env", "MY_TOKEN=tok-s3cr3t-value",
            "--set", "train.max_steps=20", "--set", "run.dir=runs", "--set", "run.name=fr"]  # fmt: skip
    code, out = launch(args, tmp_path)
    assert code == 0, out
    data = json.loads((tmp_path / "logs/fr1/job.json").read_text())
    assert "tok-s3cr3t-value" not in json.dumps(data)
    host = data["metrics"]["host"]
    run = work[host] / "runs/fr"
    holders = [h for h, w in work.items() if (w / "runs/fr/best.pt").exists()]
    assert host in holders and len(holders) == 2, holders  # rank 0's node and its replica's (replicas: 1)

    for what, name in (
        ("best", "best.pt"),
        ("last", "checkpoints/step-00000020.pt"),
        ("metrics", "metrics.jsonl"),
    ):
        code, out = launch(["fetch", "fr1", what, "--to", "results"], tmp_path)
        assert code == 0, out
        got = tmp_path / "results" / Path(name).name
        assert sha(got) == sha(run / name), what
        assert f"from {host}:{run / name}" in out

    code, out = launch(["restart", "fr1", "--set", "train.max_steps=30"], tmp_path)
    assert code == 2 and "--env MY_TOKEN is masked in job.json; export MY_TOKEN" in out, out
    again = Launcher(["restart", "fr1", "--set", "train.max_steps=30", "--job-id", "fr2"], tmp_path,
                     env={"MY_TOKEN": "tok-s3cr3t-value"})  # fmt: skip
    try:
        code = again.wait(300)
    finally:
        again.stop()
    assert code == 0, again.text
    assert "restart of job fr1" in again.text
    assert re.search(r"resumed from .*/step-00000020\.pt at step 20 of job fr1", again.text), again.text
    new = json.loads((tmp_path / "logs/fr2/job.json").read_text())
    assert "--fresh" not in new["argv"] and "fr1" not in new["argv"]
    assert new["argv"][-4:] == ["--set", "train.max_steps=30", "--job-id", "fr2"]
    assert (run / "checkpoints/step-00000030.pt").exists()
