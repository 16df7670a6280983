"""tools/prom_plot.py against a local HTTP server answering /api/v1/query_range as Prometheus does:
the PNG is written from both queries; an empty panel, an error answer or no server is one line, exit 1."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "prom_plot.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _series(name: str, node: str, start: float, values: list[float]) -> dict:
    return {
        "metric": {"__name__": name, "node": node},
        "values": [[start + 2 * i, str(v)] for i, v in enumerate(values)],
    }


class _Prometheus(BaseHTTPRequestHandler):
    answers: dict[str, dict] = {}
    queries: list[dict[str, list[str]]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        params = urllib.parse.parse_qs(url.query)
        type(self).queries.append(params)
        body = json.dumps(self.answers.get(params["query"][0], {"status": "success", "data": {"result": []}}))
        status = 400 if '"error"' in body else 200 if url.path == "/api/v1/query_range" else 404
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def prom() -> Iterator[str]:
    _Prometheus.answers, _Prometheus.queries = {}, []
    server = HTTPServer(("127.0.0.1", 0), _Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_line_names():
    plot = _load()
    assert plot.line_name({"node": "node0"}, "mean") == "node0 mean"
    assert plot.line_name({"node": "node1", "run": "r1"}, "") == "node1 run=r1"


def _load():
    spec = importlib.util.spec_from_file_location("prom_plot", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _ok(result: list[dict]) -> dict:
    return {"status": "success", "data": {"resultType": "matrix", "result": result}}


def test_renders_the_gpu_utilization_and_loss_series(prom, tmp_path):
    """Mean and min utilization per node and the loss of the one run --run names, in that order."""
    pytest.importorskip("matplotlib")
    t0 = 1_764_870_000.0
    _Prometheus.answers = {
        "avg by (node) (ddp_gpu_utilization_percent)": _ok(
            [_series("", "node0", t0, [75, 80, 78]), _series("", "node1", t0, [75, 74, 76])]
        ),
        "min by (node) (ddp_gpu_utilization_percent)": _ok(
            [_series("", "node0", t0, [0, 0, 0]), _series("", "node1", t0, [70, 71, 72])]
        ),
        'ddp_train_loss{run="r1"}': _ok([_series("ddp_train_loss", "node0", t0 + 2, [2.1, 1.9])]),
    }
    out = tmp_path / "m.png"
    res = _run("--url", prom, "--minutes", "5", "--step", "3", "--run", "r1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert [q["query"][0] for q in _Prometheus.queries] == list(_Prometheus.answers)
    q = _Prometheus.queries[0]
    assert q["step"] == ["3.0"] and float(q["end"][0]) - float(q["start"][0]) == pytest.approx(300)


def test_no_series_error_answer_or_no_server_is_one_line(prom, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "m.png"
    res = _run("--url", prom, "--out", str(out))
    assert res.returncode == 1 and not out.exists()
    assert res.stderr.strip().splitlines() == [
        "prom_plot: no GPU utilization (%) or training loss series in the last 10 min"
    ]

    _Prometheus.answers = {
        "avg by (node) (ddp_gpu_utilization_percent)": {"status": "error", "error": "parse error at char 3"}
    }
    res = _run("--url", prom, "--out", str(out))
    assert res.returncode == 1 and "parse error at char 3" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1

    res = _run("--url", "file:///etc/passwd", "--out", str(out))
    assert res.returncode == 1 and "not an http(s) URL" in res.stderr and "Traceback" not in res.stderr

    res = _run("--url", "http://127.0.0.1:9", "--out", str(out))  # discard port: nothing listens
    assert res.returncode == 1 and res.stderr.startswith("prom_plot: http://127.0.0.1:9: ")
    assert "Traceback" not in res.stderr and not out.exists()
