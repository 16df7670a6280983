"""The launcher at scale (issue #19): bounded fan-out (--forks), the open-file limit, the pair probe's
retry and its names for no route / dropped SYN / refused, and the neighbour-table warning."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddp_train.launch import node
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.preflight import preflight
from ddp_train.launch.remote import fanout, limits

REPO = Path(__file__).resolve().parents[2]


def test_parallel_runs_at_most_forks_at_once_and_keeps_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "_forks", None)  # whatever an earlier in-process ddp-launch set
    running, peak, lock = [0], [0], threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return i * i

    assert fanout.parallel(work, list(range(12)), forks=3) == [i * i for i in range(12)]
    assert peak[0] == 3
    peak[0] = 0
    fanout.parallel(work, list(range(12)))  # no bound set: one thread per item
    assert peak[0] > 3
    assert (fanout.rounds(12, 3), fanout.rounds(13, 3), fanout.rounds(12)) == (4, 5, 1)


@pytest.mark.parametrize(
    ("cfg", "want"), [("[defaults]\nforks = 7\n", 7), ("[defaults]\nnocows = True\n", 5)]
)
def test_default_forks_come_from_ansible_cfg_else_ansibles_default(
    tmp_path: Path, cfg: str, want: int
) -> None:
    (tmp_path / "ansible.cfg").write_text(cfg)
    code = "from ddp_train.launch.remote.fanout import ansible_forks; print(ansible_forks())"
    env = {**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg")}
    env.pop("ANSIBLE_FORKS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == str(want)


def test_forks_below_one_is_refused_in_one_line() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_train.launch.cli",
            "doctor",
            "--hosts",
            str(REPO / "inventory/local"),
            "--forks",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == "ddp-launch: error: --forks 0: must be >= 1"


def test_soft_nofile_is_raised_to_the_hard_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, v: calls.append(v))
    assert limits.raise_nofile(64) == 4096
    assert calls == [(4096, 4096)]


def test_too_many_nodes_for_the_hard_limit_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    with pytest.raises(LaunchError) as e:
        limits.raise_nofile(1000)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"1000 nodes need about {limits.fds_needed(1000)} open files" in msg
    assert "limit is 1024" in msg and "ulimit -n" in msg


def test_a_real_low_hard_limit_refuses_before_any_connection() -> None:
    hosts = ",".join(f"198.18.{i // 200}.{i % 200 + 1}" for i in range(300)) + ","  # RFC 2544: unused
    cli = f"{sys.executable} -m ddp_train.launch.cli doctor --hosts {hosts} --connect-timeout 1"
    script = f"ulimit -Sn 256 && ulimit -Hn 512 && exec {cli}"  # soft 256 is raised to 512, still short
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1
    assert "300 nodes need about" in res.stderr and "limit is 512" in res.stderr


def _connector(targets: list, token: str = "tok", timeout: float = 1) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", node.script("connector"), json.dumps(targets), token, str(timeout)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("DDP-CONNECT "))
    return json.loads(line[len("DDP-CONNECT ") :])


def test_connector_retries_a_failed_connect_once_and_names_the_errno() -> None:
    with socket.socket() as closed:  # bound, never listening: connects are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        out = _connector([["k", "127.0.0.1", port]])
    assert out["k"] == "ECONNREFUSED Connection refused (twice)"


def test_connector_does_not_retry_a_connection_that_was_answered() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.1)  # the server polls `done`: a second connection is never expected to come
    port, seen, done = srv.getsockname()[1], [], threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            seen.append(1)
            if len(seen) == 1:
                c.close()  # first attempt: closed without the token (as a half-dead listener would)
            else:
                c.sendall(b"tok\n")
                c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    out = _connector([["k", "127.0.0.1", port]])
    done.set()
    t.join(5)
    srv.close()
    # a connection closed without the token is "answered by another program", which is not retried
    assert out["k"].startswith("answered by another program")
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("result", "words"),
    [
        (
            "EHOSTUNREACH No route to host (twice)",
            ["neighbour table", "No route", "gc_thresh3", "cluster_hosts"],
        ),
        ("timed out after 3s (twice)", ["packets dropped", "firewall"]),
        ("ECONNREFUSED Connection refused (twice)", ["REJECT rule", "Connection refused"]),
    ],
)
def test_unreachable_names_no_route_apart_from_drops_and_refusals(result: str, words: list[str]) -> None:
    msg = preflight._unreachable("node3|ephemeral|10.0.0.3|40000", result)
    for w in words:
        assert w in msg
    others = {"neighbour table", "packets dropped", "REJECT rule"} - {words[0]}  # each kind's own hint only
    assert not any(o in msg for o in others)
    assert "EHOSTUNREACH" not in msg and "ECONNREFUSED" not in msg


def test_gc_thresh3_below_four_per_node_warns_with_the_sysctl_and_role() -> None:
    checks = [preflight.NodeCheck(plan=None, facts={"gc_thresh3": v}) for v in (1024, 4096, 256)]  # type: ignore[arg-type]
    checks += [preflight.NodeCheck(plan=None) for _ in range(297)]  # type: ignore[arg-type]
    preflight._check_neighbour_table(checks)
    assert [len(c.warnings) for c in checks[:3]] == [1, 0, 1]
    assert "net.ipv4.neigh.default.gc_thresh3 is 1024, below 4 x 300 nodes = 1200" in checks[0].warnings[0]
    assert "role cluster_hosts" in checks[0].warnings[0]
    assert not any(c.warnings for c in checks[3:])  # no fact, no warning


def test_ddp_forks_is_read_from_the_inventory_and_checked() -> None:
    from ddp_train.launch.plan.inventory import load_nodes

    local = str(REPO / "inventory" / "local")
    assert {n.forks for n in load_nodes([local], extra_vars=["ddp_forks=3"])} == {3}
    assert {n.forks for n in load_nodes([local])} == {None}
    with pytest.raises(LaunchError, match="ddp_forks.*not a positive integer"):
        load_nodes([local], extra_vars=["ddp_forks=0"])
