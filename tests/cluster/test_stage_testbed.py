"""`ddp-launch stage` on three namespace hosts with a management and a training network (issue 30 item 3).

The controller sends the data to one node; the other two get it from a node over the training network
(the addresses the output names are in it). A rerun sends nothing; a file corrupted on one node is the
only one sent again; a launcher killed mid-copy leaves a part that the next run continues, as does a
part left on a node that gets its copy from another node. Each host has its own ddp_workdir; the hosts
share this machine's filesystem otherwise. Testbed prefix stg, nets 10.213.182 (SSH) and 10.213.183.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.test_launch_testbed import Launcher, launch, make_inventory
from tests.conftest import private_testbed
from tests.testbed import Testbed, worker_net, worker_prefix

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

TRAIN_NET = worker_net("10.213.183")
BIG = 192 << 20


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with private_testbed(worker_prefix("stg"), worker_net("10.213.182"), 3, train_net=TRAIN_NET) as bed:
        yield bed


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_stage_skip_repair_resume(tb: Testbed, tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    (src / "shards").mkdir(parents=True)
    (src / "meta.json").write_text('{"vocab": 50257}\n')
    (src / "shards" / "train 0.bin").write_bytes(os.urandom(6 << 20))
    (src / "shards" / "val.bin").write_bytes(os.urandom(1 << 20))
    work = {f"node{i}": tmp_path / f"work {i}" for i in range(3)}
    for w in work.values():
        w.mkdir()
    inv = make_inventory(tb, tmp_path, host_vars={h: {"ddp_workdir": str(w)} for h, w in work.items()})
    args = ["stage", str(src), "--to", "data/corpus", "--hosts", str(inv)]

    def same_everywhere() -> None:
        for w in work.values():
            for f in ("meta.json", "shards/train 0.bin", "shards/val.bin"):
                assert sha(w / "data/corpus" / f) == sha(src / f), (w, f)

    code, out = launch(args, tmp_path)
    assert code == 0, out
    sent = re.findall(r"^stage: (node\d): 3 file\(s\), (\d+) bytes sent from this machine", out, re.M)
    assert len(sent) == 1 and int(sent[0][1]) == sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    pulled = re.findall(r"^stage: (node\d): 3 file\(s\) from (node\d) \(([\d.]+)\)", out, re.M)
    assert len(pulled) == 2, out
    for _, _, address in pulled:  # node to node over the training network, not the SSH one
        assert ipaddress.ip_address(address) in ipaddress.ip_network(f"{TRAIN_NET}.0/24")
    same_everywhere()

    code, out = launch(args, tmp_path)
    assert code == 0 and out.count("up to date") == 3, out
    assert "bytes sent" not in out.replace("0 bytes sent", "")

    bad = work["node2"] / "data/corpus/shards/val.bin"
    kept = (work["node2"] / "data/corpus/shards/train 0.bin").stat().st_ino
    bad.write_bytes(b"bit rot")
    code, out = launch(args, tmp_path)
    assert code == 0, out
    assert re.search(r"^stage: node2: 1 file\(s\) from node[01] ", out, re.M), out
    assert out.count("up to date") == 2
    assert (work["node2"] / "data/corpus/shards/train 0.bin").stat().st_ino == kept  # not sent again
    same_everywhere()

    # a node that gets its copy from another node continues the part it has
    train0 = work["node1"] / "data/corpus/shards/train 0.bin"
    part = work["node1"] / "data/corpus/.ddp-stage" / f"{sha(train0)}.part"
    part.write_bytes(train0.read_bytes()[: 2 << 20])
    train0.unlink()
    code, out = launch(args, tmp_path)
    assert code == 0, out
    assert re.search(r"^stage: node1: 1 file\(s\) from node[02] \([\d.]+\) \(1 resumed\)", out, re.M), out
    same_everywhere()


def test_killed_launcher_resumes(tb: Testbed, tmp_path: Path) -> None:
    """The launcher dies while the controller streams a big file: the part stays, the rerun continues it."""
    src = tmp_path / "big"
    src.mkdir()
    (src / "blob.bin").write_bytes(os.urandom(BIG))
    work = {f"node{i}": tmp_path / f"work {i}" for i in range(3)}
    for w in work.values():
        w.mkdir()
    inv = make_inventory(tb, tmp_path, host_vars={h: {"ddp_workdir": str(w)} for h, w in work.items()})
    args = ["stage", str(src), "--to", "big", "--hosts", str(inv)]
    parts = [w / "big/.ddp-stage" for w in work.values()]
    run = Launcher(args, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and run.proc.poll() is None:
            grown = [p for d in parts if d.is_dir() for p in d.iterdir() if p.stat().st_size >= 8 << 20]
            if grown:
                break
            time.sleep(0.02)
        assert run.proc.poll() is None, f"finished before it could be interrupted:\n{run.text}"
        run.proc.send_signal(signal.SIGKILL)
        run.wait(30)
    finally:
        run.stop()
    left = [p for d in parts if d.is_dir() for p in d.iterdir()]
    assert len(left) == 1 and 0 < left[0].stat().st_size < BIG, left
    code, out = launch(args, tmp_path, timeout=600)
    assert code == 0, out
    m = re.search(r"^stage: node\d: 1 file\(s\), (\d+) bytes sent from this machine \(1 resumed\)", out, re.M)
    assert m and int(m.group(1)) < BIG, out
    for w in work.values():
        assert sha(w / "big/blob.bin") == sha(src / "blob.bin")
        assert not list((w / "big/.ddp-stage").iterdir())
