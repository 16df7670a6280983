"""Checkpoint replicas (replica.py): the transfer, its sha256 check, the copy's use on resume."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import select
import socket
import time
from pathlib import Path

import pytest

from ddp_train import checkpoint, replica
from ddp_train.checkpoint import Checkpointer, CorruptCheckpoint
from tests.unit.test_train_checkpoint import state


@pytest.fixture
def receiver(tmp_path: Path):
    r = replica.Receiver(tmp_path / "node1", keep_latest_k=2, master_addr="127.0.0.1", timeout_s=10)
    yield r
    r.close()


def send(path: Path, *receivers: replica.Receiver) -> replica.Sender:
    sender = replica.Sender([(1, f"node{i + 1}", r.address) for i, r in enumerate(receivers)], timeout_s=10)
    sender.send(path)
    assert sender.wait(20)
    return sender


@pytest.mark.parametrize(
    ("world", "local", "replicas", "expected"),
    [(8, 4, 1, [4]), (4, 4, 1, []), (6, 2, 2, [2, 4]), (6, 2, 5, [2, 4]), (8, 4, 0, []), (1, 1, 1, [])],
)
def test_the_first_rank_of_the_next_nodes_keeps_the_replicas(world, local, replicas, expected):
    assert replica.receivers(0, world, local, replicas) == expected


def test_a_saved_checkpoint_arrives_byte_identical_with_its_sha256_and_origin(tmp_path, receiver, caplog):
    caplog.set_level(logging.INFO, "ddp_train")
    src = checkpoint.save(state(10), tmp_path / "node0", 10)
    assert send(src, receiver).results[src] == []
    copy = tmp_path / "node1" / src.name
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    assert copy.read_bytes() == src.read_bytes()
    info = json.loads(checkpoint.replica_info(copy).read_text())
    assert info["sha256"] == sha and info["from"] == socket.gethostname()
    assert sorted(p.name for p in copy.parent.iterdir()) == [src.name, src.name + ".replica.json"]
    loaded = checkpoint.load(copy)
    assert loaded["step"] == 10 and loaded["replica_from"] == socket.gethostname()
    assert re.search(rf"saved replica node1:{src.name} in \d+\.\d\ds \(sha256 {sha[:12]}\)", caplog.text)
    line = checkpoint.resumed_line(copy, loaded, "node1", 0)
    assert line.endswith(f"at step 10, a replica sent by {socket.gethostname()}")


def test_the_receiver_keeps_latest_k_and_prunes_their_sha256_files(tmp_path, receiver):
    for step in (10, 20, 30):
        send(checkpoint.save(state(step), tmp_path / "node0", step), receiver)
    names = sorted(p.name for p in (tmp_path / "node1").iterdir())
    assert names == [f"step-000000{s}.pt{x}" for s in (20, 30) for x in ("", ".replica.json")]


def test_bytes_that_do_not_match_their_sha256_are_discarded_with_one_warning(tmp_path, receiver, caplog):
    src = checkpoint.save(state(10), tmp_path / "node0", 10)
    ip, port, token = receiver.address.split("|")
    data = src.read_bytes()
    with socket.create_connection((ip, int(port)), timeout=10) as conn:
        f = conn.makefile("rb")
        header = {"name": src.name, "size": len(data), "mtime_ns": 0, "token": token, "host": "node0"}
        conn.sendall(json.dumps(header).encode() + b"\n")
        assert f.readline() == b"send\n"
        flipped = data[:100] + bytes([data[100] ^ 1]) + data[101:]  # one bit changed on the way
        conn.sendall(flipped + hashlib.sha256(data).hexdigest().encode() + b"\n")
        assert f.readline() == b"bad sha256 mismatch\n"
    for _ in range(100):  # the receiver logs after answering
        if caplog.records:
            break
        time.sleep(0.05)
    assert not list((tmp_path / "node1").glob("step-*")), "nothing published, no temp left"
    [record] = caplog.records
    assert record.levelname == "WARNING" and "\n" not in record.getMessage()
    assert "sha256" in record.getMessage() and "discarded" in record.getMessage()


def test_a_stray_connection_without_the_token_writes_nothing(tmp_path, receiver):
    ip, port, _ = receiver.address.split("|")
    with socket.create_connection((ip, int(port)), timeout=10) as conn:
        header = {"name": "step-00000010.pt", "size": 3, "mtime_ns": 0, "token": "guess", "host": "x"}
        conn.sendall(json.dumps(header).encode() + b"\n")
        assert conn.makefile("rb").readline() == b"bad refused\n"
    assert not (tmp_path / "node1").exists()


def test_a_corrupt_replica_is_ignored_with_one_warning_and_the_previous_one_resumes(
    tmp_path, receiver, caplog
):
    for step in (10, 20):
        send(checkpoint.save(state(step), tmp_path / "node0", step), receiver)
    node1 = tmp_path / "node1"
    info = checkpoint.replica_info(node1 / "step-00000020.pt")
    info.write_text(json.dumps({**json.loads(info.read_text()), "sha256": "0" * 64}))  # bytes changed since
    with pytest.raises(CorruptCheckpoint, match="replica sha256 .* differs from 000000000000 sent by"):
        checkpoint.load(node1 / "step-00000020.pt")
    loaded, path = checkpoint.load_latest(node1)
    assert path.name == "step-00000010.pt" and loaded["step"] == 10
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "\n" not in record.getMessage() and "falling back to step-00000010.pt" in record.getMessage()
    assert (node1 / "step-00000020.pt.corrupt").exists() and not info.exists()


def test_a_shared_directory_is_not_copied_onto_itself(tmp_path):
    r = replica.Receiver(tmp_path / "shared", keep_latest_k=2, master_addr="127.0.0.1", timeout_s=10)
    try:
        src = checkpoint.save(state(10), tmp_path / "shared", 10)
        before = src.stat().st_ino
        assert send(src, r).results[src] == []
        assert src.stat().st_ino == before and not checkpoint.replica_info(src).exists()
    finally:
        r.close()


def test_an_own_save_over_a_replica_drops_its_sha256_file(tmp_path, receiver):
    send(checkpoint.save(state(10), tmp_path / "node0", 10), receiver)
    copy = checkpoint.save(state(10), tmp_path / "node1", 10)  # node1, rank 0 now, saves step 10 again
    assert not checkpoint.replica_info(copy).exists()
    assert "replica_from" not in checkpoint.load(copy)


def unreachable_replicas(tmp_path: Path) -> replica.Replicas:
    """Rank 0's Replicas whose one receiver (node1) listens nowhere."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    reps = replica.Replicas(tmp_path / "node0", rank=0, local_rank=0, world_size=4, local_world_size=2,
                            replicas=1, keep_latest_k=2, master_addr="127.0.0.1", timeout_s=5)  # fmt: skip
    reps.connect([{"host": "node0"}, {}, {"host": "node1", "replica_addr": f"127.0.0.1|{port}|t"}, {}])
    return reps


def test_an_unreachable_receiver_is_one_warning_and_finish_says_the_copy_did_not_complete(tmp_path, caplog):
    caplog.set_level(logging.INFO, "ddp_train")
    reps = unreachable_replicas(tmp_path)
    reps.send(checkpoint.save(state(10), tmp_path / "node0", 10))
    reps.finish(5)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings), warnings
    assert warnings[0].startswith("replica of step-00000010.pt to node1 (rank 2) failed: ")
    assert warnings[1] == "the replica of step-00000010.pt did not complete: it is on this node only"


def test_finish_waits_for_a_best_pt_queued_alone_and_names_it_when_it_failed(tmp_path, caplog):
    """checkpoint.interval_steps=0 with eval: only best.pt is queued; finish() waits for it too."""
    reps = unreachable_replicas(tmp_path)
    best = checkpoint.save_file(state(10), tmp_path / "best.pt")
    reps.send_best(best)
    reps.finish(5)
    assert reps.sender is not None and reps.sender.wait(0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings[-1] == "the replica of best.pt did not complete: it is on this node only", warnings


def test_a_receiver_that_cannot_listen_leaves_its_node_without_a_replica(tmp_path, caplog):
    reps = replica.Replicas(tmp_path, rank=0, local_rank=0, world_size=2, local_world_size=1, replicas=1,
                            keep_latest_k=2, master_addr=None, timeout_s=5)  # fmt: skip
    reps.connect([{"host": "node0"}, {"host": "node1", "replica_error": "cannot listen: x"}])
    assert reps.sender is None
    assert caplog.records[0].getMessage() == "no checkpoint replica on node1 (rank 1): cannot listen: x"


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        ([{"step": 10}, {"step": 20, "copy": True}], 1),  # the newest, even a replica
        ([{"step": 20, "copy": True}, {"step": 20}], 1),  # a tie: the node's own save
        ([{"step": 20}, {"step": 20}], 0),  # a tie of equals: the lowest rank
        ([{"step": None}, {}], None),
    ],
)
def test_resume_source_is_the_newest_step_then_an_own_save_then_the_lowest_rank(reports, expected):
    assert checkpoint.source_rank(reports) == expected


def test_a_silent_connection_does_not_hold_up_the_next_transfer(tmp_path, receiver):
    ip, port, _ = receiver.address.split("|")
    with socket.create_connection((ip, int(port)), timeout=10):  # connected, never sends a byte
        src = checkpoint.save(state(10), tmp_path / "node0", 10)
        sender = replica.Sender([(1, "node1", receiver.address)], timeout_s=10)
        sender.send(src)
        assert sender.wait(5) and sender.results[src] == []


def test_a_peer_trickling_bytes_without_a_token_is_dropped_after_token_timeout_s(
    tmp_path, receiver, monkeypatch
):
    monkeypatch.setattr(replica, "TOKEN_TIMEOUT_S", 0.5, raising=False)  # the receiver's timeout_s is 10
    ip, port, _ = receiver.address.split("|")
    t0 = time.monotonic()
    with socket.create_connection((ip, int(port)), timeout=10) as conn:
        while time.monotonic() - t0 < 8:
            try:
                conn.sendall(b" ")  # a byte every 0.2 s: each read returns well within any timeout
            except OSError:
                break
            if select.select([conn], [], [], 0.2)[0]:
                assert conn.recv(100) == b""
                break
    assert time.monotonic() - t0 < 3


def test_the_token_is_compared_in_constant_time(tmp_path, receiver, monkeypatch):
    calls = []
    compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or compare(a, b))
    test_a_stray_connection_without_the_token_writes_nothing(tmp_path, receiver)
    assert calls == [(b"guess", receiver.token.encode())]


def test_a_name_ending_in_a_newline_is_refused(tmp_path, receiver):
    assert checkpoint.step_of("step-00000010.pt\n") is None
    ip, port, token = receiver.address.split("|")
    with socket.create_connection((ip, int(port)), timeout=10) as conn:
        header = {"name": "step-00000010.pt\n", "size": 3, "mtime_ns": 0, "token": token, "host": "x"}
        conn.sendall(json.dumps(header).encode() + b"\n")
        assert conn.makefile("rb").readline() == b"bad refused\n"
    assert not (tmp_path / "node1").exists()


def test_close_ends_the_receivers_accept_promptly(receiver):
    ip, port, _ = receiver.address.split("|")
    receiver.close()
    with pytest.raises(ConnectionRefusedError):  # a blocked accept() would keep the socket listening
        socket.create_connection((ip, int(port)), timeout=5).close()
    receiver.thread.join(2)
    assert not receiver.thread.is_alive()


def test_rank_0_gives_up_on_a_stalled_replica_well_before_the_others_wait_ends(tmp_path, caplog):
    copies = replica.Replicas(tmp_path / "node0", rank=0, local_rank=0, world_size=2, local_world_size=1,
                              replicas=1, keep_latest_k=0, master_addr="127.0.0.1", timeout_s=4)  # fmt: skip
    ckpt = Checkpointer(tmp_path / "node0", rank=0, local_rank=0, io_timeout_s=4, replicas=copies)
    with socket.socket() as stalled:  # listens, never accepts: connect succeeds, no answer ever comes
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(1)
        port = stalled.getsockname()[1]
        ckpt.replicas.connect([{"host": "node0"}, {"host": "node1", "replica_addr": f"127.0.0.1|{port}|t"}])
        ckpt.replicas.send(checkpoint.save(state(10), tmp_path / "node0", 10))
        t0 = time.monotonic()
        ckpt.finish()  # the other ranks wait io_timeout_s=4 on the store for this
        assert time.monotonic() - t0 < 3
        # read before the listener closes: its reset makes the abandoned sender warn once more (CI)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # the abandoned sender ends on the reset within the test (after it, its warning hit a closed stream)
    assert ckpt.replicas.sender is not None and ckpt.replicas.sender.wait(10)
    assert warnings == [
        "the replica of step-00000010.pt on node1 did not complete within 2s: it is on this node only"
    ]


def test_best_pt_reaches_the_replica_node_as_a_link_to_its_copy_or_as_its_own_bytes(tmp_path, caplog):
    """#48: best.pt survived only on rank 0's node. Linked to a checkpoint there, it becomes a hard link
    to the receiver's verified copy of that checkpoint (no second transfer); written on its own (a step
    that is no checkpoint), its bytes are sent, checked and kept beside the receiver's checkpoints."""
    caplog.set_level(logging.INFO, "ddp_train")
    best_there = tmp_path / "node1" / "run" / "best.pt"
    r = replica.Receiver(tmp_path / "node1" / "run" / "checkpoints", 2, "127.0.0.1", 10, best_path=best_there)
    try:
        sender = replica.Sender([(1, "node1", r.address)], timeout_s=10)
        src = checkpoint.save(state(10), tmp_path / "node0" / "run" / "checkpoints", 10)
        best_here = tmp_path / "node0" / "run" / "best.pt"
        best_here.hardlink_to(src)
        sender.send(src, (best_here, src))
        assert sender.wait(20) and sender.results == {src: [], best_here: []}
        copy = r.directory / src.name
        assert best_there.stat().st_ino == copy.stat().st_ino  # a link to the copy, not a second one
        assert checkpoint.load(best_there)["step"] == 10  # with its sha256 record: checked as it loads
        assert "best.pt is the replica step-00000010.pt (a hard link)" in caplog.text
        assert len(re.findall(r"saved replica node1:", caplog.text)) == 1  # the checkpoint's bytes only
        best_here.unlink()
        checkpoint.save_file(state(12), best_here)  # a new best at step 12, no checkpoint of it
        sender.send(None, (best_here, src))  # a stale link hint: best.pt is no longer that file
        assert sender.wait(20) and sender.results[best_here] == []
        assert best_there.read_bytes() == best_here.read_bytes()
        assert best_there.stat().st_ino != copy.stat().st_ino and copy.exists()
        assert (
            json.loads(checkpoint.replica_info(best_there).read_text())["sha256"]
            == hashlib.sha256(best_here.read_bytes()).hexdigest()
        )
    finally:
        r.close()


def test_best_pt_is_never_linked_to_an_older_file_of_the_same_name_and_size(tmp_path, caplog):
    """The receiver holds a verified step-10 from an earlier run (same name, same size); this run's send
    of its step 10 fails: best.pt must not become a link to the old weights (review of #48)."""
    best_there = tmp_path / "node1" / "run" / "best.pt"
    r = replica.Receiver(tmp_path / "node1" / "run" / "checkpoints", 2, "127.0.0.1", 10, best_path=best_there)
    try:
        old = checkpoint.save(state(10), tmp_path / "old", 10)
        send(old, r)  # the earlier run's step 10, verified there
        other = state(10)
        other["model"]["w"] = other["model"]["w"] + 1  # another run's weights at the same step
        new = checkpoint.save(other, tmp_path / "node0" / "run" / "checkpoints", 10)
        assert new.stat().st_size == old.stat().st_size and new.read_bytes() != old.read_bytes()
        best_here = new.parent.parent / "best.pt"
        best_here.hardlink_to(new)
        sender = replica.Sender([(1, "node1", r.address)], timeout_s=10)
        real = sender._send_one
        sender._send_one = lambda path, *a: (
            (_ for _ in ()).throw(OSError("reset")) if path == new else real(path, *a)
        )  # this run's step 10 does not get there
        sender.send(new, (best_here, new))
        assert sender.wait(20) and sender.results[new] == ["node1"] and sender.results[best_here] == []
        assert best_there.read_bytes() == new.read_bytes()  # its own bytes: no link to the old copy
        assert best_there.stat().st_ino != (r.directory / new.name).stat().st_ino
    finally:
        r.close()
