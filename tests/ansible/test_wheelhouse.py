"""The pytorch role fetches the pinned set from the index once per cluster: the wheelhouse host downloads
it, keeps every file's sha256 in a lock, and serves it over the cluster network while every node installs
exactly those files with --no-index --require-hashes. The nodes have outbound traffic dropped (nftables
in each namespace): only the wheelhouse host may reach "the index" (an HTTP server on the controller)
in the first case, none in the air-gapped case, which copies the controller's wheels once instead.

The pinned set is small: a stand-in torch wheel (torch 2.13.0+cpu, a few bytes, enough for the role's
fingerprint and its pinned-version check) and the real PyYAML wheel, so no host downloads torch here. In
the first test "the index" is two, shaped like PyTorch's and PyPI's (tests/testbed/pyindex.py): the torch
stub requires what the real torch requires, PyTorch's index spells typing_extensions and Jinja2 as it does
(pip before 23.2, which the nodes' venvs start with, rejects them), and both indexes carry another
typing_extensions (4.15.0 and 4.16.0), which only one resolution over both turns into one version.
Testbed prefix prv, net 10.213.120."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import tests.conftest as root_conftest
from tests.testbed import pyindex

pytestmark = pytest.mark.testbed

NET = "10.213.120"
INDEX = f"{NET}.1"  # the controller, on the testbed's bridge
INDEX_PORT = 18765
VENV = "/opt/ddp-train/venv"
WHEELHOUSE = "/var/cache/ddp-train/wheelhouse"
PINNED = ["pyyaml==6.0.4"]


def _fake_wheel(dest: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel of the given files."""
    info = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return whl


def _fake_torch(dest: Path) -> Path:
    """A wheel named torch 2.13.0+cpu: __version__ and version.cuda, nothing else."""
    init = '__version__ = "2.13.0+cpu"\nfrom . import version  # noqa\n'
    return _fake_wheel(
        dest, "torch", "2.13.0+cpu", {"torch/__init__.py": init, "torch/version.py": "cuda = None\n"}
    )


def _drop_outbound(tb, host, allow_index: bool) -> None:
    """Outbound traffic of the host dropped, except its cluster peers (and the index, if allowed).

    The host's pip configuration (this machine's, through the /etc overlay) goes too: pip knows only
    what the role tells it."""
    index_rule = f"ip daddr {INDEX} tcp dport {INDEX_PORT} accept; " if allow_index else ""
    pip_conf = "/etc/pip.conf /etc/xdg/pip/pip.conf /root/.config/pip/pip.conf /root/.pip/pip.conf"
    tb.exec(host, f"nft delete table inet prvout 2>/dev/null; rm -f {pip_conf}")
    tb.exec(
        host,
        "nft -f - <<'EOF'\ntable inet prvout {\n chain output {\n"
        "  type filter hook output priority 0; policy drop;\n"
        f"  oif lo accept; ct state established,related accept; {index_rule}\n"
        f"  ip daddr {INDEX} counter drop; ip daddr {NET}.0/24 accept;\n }}\n}}\nEOF",
    )


def _can_reach_index(tb, host) -> bool:
    probe = f"import socket; socket.create_connection(('{INDEX}', {INDEX_PORT}), timeout=2)"
    return tb.exec(host, f'python3 -c "{probe}"', check=False).returncode == 0


@pytest.fixture(scope="module")
def cluster():
    with root_conftest.private_testbed("prv", NET, 3) as tb:
        yield tb


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """On the controller, over HTTP: /whl/ shaped like PyTorch's index, /simple/ like PyPI (PEP 658 both)."""
    root = tmp_path_factory.mktemp("index")
    real = root / "real"
    dl = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(real)]
    subprocess.run([*dl, *PINNED, "pip"], check=True, capture_output=True, timeout=300)
    stubs = root / "stubs"
    requires = pyindex.torch_requirements()
    torch = pyindex.wheel(stubs / "whl", pyindex.torch_stub("2.13.0+cpu", None, requires))
    deps = pyindex.stand_ins([*requires, "markupsafe>=2.0"], {"typing-extensions": "4.15.0"})
    whl = [torch, *(pyindex.wheel(stubs / "whl", d) for d in deps)]
    simple = [
        *real.glob("*.whl"),
        pyindex.wheel(stubs / "simple", pyindex.Dist("prvschema", "1.0", ["typing-extensions>=4.4"])),
        pyindex.wheel(stubs / "simple", pyindex.Dist("typing_extensions", "4.16.0")),
    ]
    pyindex.write_simple(root / "www" / "whl", whl)
    pyindex.write_simple(root / "www" / "simple", simple)
    spelt = {w.name.split("-")[0] for w in whl}
    assert {"typing_extensions", "Jinja2"} <= spelt, f"torch requires both: {requires}"
    log = root / "index.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "http.server",
                "--bind",
                INDEX,
                "--directory",
                str(root / "www"),
                str(INDEX_PORT),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _await_listening(server, log)
        yield root, log
    finally:
        server.terminate()
        server.wait(timeout=10)


def _await_listening(server: subprocess.Popen, log: Path) -> None:
    """Until the index accepts connections: Popen returns before http.server has bound its port, so on a
    loaded machine the first test's probe from node0 can come first (refused at once). Seen in a full run
    on 2026-12-06: `assert _can_reach_index(...)` failed, and with it the next test, which needs the
    first one's pinned set."""
    import socket

    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, f"the index server exited: {log.read_text()}"
        try:
            socket.create_connection((INDEX, INDEX_PORT), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, (
                f"the index server did not listen within 60 s: {log.read_text()}"
            )
            time.sleep(0.1)


def _converge(playbook, tb, **extra):
    args = {"pytorch_cuda": "cpu", "pytorch_index_url": "", "pytorch_install_os_packages": False}
    args.update({"pytorch_extra_packages": PINNED, **extra})
    return playbook("-i", str(tb.inventory), "-e", json.dumps(args), "playbooks/pytorch.yml")


def _recap(out: str) -> dict[str, int]:
    return {
        h: int(c)
        for h, c in re.findall(r"^(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0", out, re.M)
    }


def _wheel_gets(log: Path) -> list[str]:
    time.sleep(0.2)
    return re.findall(r'"GET /(\S+\.whl) HTTP', log.read_text())


@pytest.mark.slow
def test_the_index_is_read_once_and_the_nodes_install_from_the_wheelhouse(cluster, index, playbook):
    root, log = index
    hosts = cluster.hosts()
    for i, h in enumerate(hosts):
        _drop_outbound(cluster, h, allow_index=i == 0)
    assert _can_reach_index(cluster, hosts[0])
    assert not any(_can_reach_index(cluster, h) for h in hosts[1:]), "node1, node2 must have no way out"
    old_pip = cluster.exec(hosts[0], "/usr/bin/python3 -m venv /tmp/prv-v && /tmp/prv-v/bin/pip --version")
    cluster.exec(hosts[0], "rm -rf /tmp/prv-v")
    assert re.match(r"pip (2[0-2]|23\.[01])\.", old_pip.stdout), f"the venvs must start old: {old_pip.stdout}"

    indexes = {
        "pytorch_index_url": f"http://{INDEX}:{INDEX_PORT}/whl/",
        "pytorch_extra_index_url": f"http://{INDEX}:{INDEX_PORT}/simple/",
        "pytorch_pip_extra_args": f"--trusted-host {INDEX}",
        "pytorch_extra_packages": [*PINNED, "prvschema==1.0"],
    }
    res = _converge(playbook, cluster, **indexes)
    assert res.returncode == 0, res.out[-5000:]

    lock = cluster.exec(hosts[0], f"cat {WHEELHOUSE}/*/requirements.txt").stdout
    locked = re.findall(r"^(\S+)==(\S+) --hash=sha256:[0-9a-f]{64}$", lock, re.M)
    assert len(locked) == len(lock.splitlines()), lock
    # One resolution over both indexes: one typing_extensions, the newer of the two.
    assert [v for n, v in locked if pyindex.normalise(n) == "typing-extensions"] == ["4.16.0"], lock
    assert {"torch", "prvschema", "pyyaml", "jinja2"} <= {pyindex.normalise(n) for n, _ in locked}, lock
    gets = sorted(g.replace("%2B", "+").rsplit("/", 1)[1] for g in _wheel_gets(log))
    # pip < 23.2 fetches the pip wheel it upgrades to twice (after its PEP 658 metadata); the rest once.
    assert any(g.startswith("pip-") for g in gets), f"the wheelhouse host's pip was upgraded: {gets}"
    others = [g for g in gets if not g.startswith("pip-")]
    assert len(others) == len(set(others)) == len(locked), f"each locked wheel once, nothing else: {gets}"
    assert re.match(r"pip (2[4-9]|23\.[2-9])", cluster.exec(hosts[0], f"{VENV}/bin/pip --version").stdout)
    for h in hosts:
        versions = cluster.exec(
            h, f"{VENV}/bin/python -c 'import torch, yaml; print(torch.__version__, yaml.__version__)'"
        )
        assert versions.stdout.split() == ["2.13.0+cpu", "6.0.4"], h.name
        assert '"torch": "2.13.0+cpu"' in cluster.exec(h, f"cat {VENV}/ddp-train-fingerprint.json").stdout
    assert cluster.exec(hosts[1], f"cat {VENV}/share/ddp-train/wheelhouse-requirements.txt").stdout == lock
    listening = cluster.exec(hosts[0], "ss -Hltn 'sport = :29500'").stdout
    assert listening == "", "the wheelhouse is no longer served after the install"

    again = _converge(playbook, cluster, **indexes)
    assert again.returncode == 0, again.out[-5000:]
    assert _recap(again.out) == {"node0": 0, "node1": 0, "node2": 0}, again.out[-3000:]
    assert len(_wheel_gets(log)) == len(gets), "a re-run does not read the index again"


@pytest.mark.slow
def test_an_air_gapped_cluster_gets_the_controllers_wheels_once(cluster, index, playbook, tmp_path):
    # Another pinned set than the first test's: a torch stub, PyYAML and one more package.
    d = tmp_path / "wheels"
    d.mkdir()
    _fake_torch(d)
    for w in (index[0] / "real").glob("[Pp]y[Yy][Aa][Mm][Ll]*.whl"):
        shutil.copy(w, d)
    _fake_wheel(d, "prvextra", "1.0", {"prvextra.py": "OK = 1\n"})
    pinned = [*PINNED, "prvextra==1.0"]
    hosts = cluster.hosts()
    for h in hosts:
        _drop_outbound(cluster, h, allow_index=False)
    assert not any(_can_reach_index(cluster, h) for h in hosts)

    # Something listening on the wheelhouse's port (MASTER_PORT) of node0: refused in one line.
    listener = "import socket, time; s = socket.create_server(('', 29500)); time.sleep(600)"
    cluster.exec(
        hosts[0], f'setsid python3 -c "{listener}" > /dev/null 2>&1 < /dev/null & echo $! > /tmp/prv-l.pid'
    )
    try:
        busy = _converge(playbook, cluster, pytorch_wheelhouse_src=str(d), pytorch_extra_packages=pinned)
    finally:
        cluster.exec(hosts[0], "kill $(cat /tmp/prv-l.pid); rm -f /tmp/prv-l.pid", check=False)
    assert busy.returncode == 2, busy.out[-3000:]
    assert "port 29500 is in use on the wheelhouse host node0" in busy.out, busy.out[-3000:]

    res = _converge(playbook, cluster, pytorch_wheelhouse_src=str(d), pytorch_extra_packages=pinned)
    assert res.returncode == 0, res.out[-5000:]
    assert re.search(
        r"Copy the controller's wheels into the wheelhouse \(air-gapped\)\] \**\nchanged: \[node0", busy.out
    )
    sets = cluster.exec(hosts[0], f"ls {WHEELHOUSE}").stdout.split()
    assert len(sets) == 2, f"a second pinned set (from the controller's wheels) next to the first: {sets}"
    for h in hosts:
        marker = cluster.exec(h, f"cat {VENV}/share/ddp-train/installed-wheelhouse.sha1").stdout
        lock = cluster.exec(
            h, f"sha1sum < {VENV}/share/ddp-train/wheelhouse-requirements.txt"
        ).stdout.split()[0]
        assert marker == lock, h.name
        assert cluster.exec(h, f"{VENV}/bin/python -c 'import yaml, prvextra'", check=False).returncode == 0
