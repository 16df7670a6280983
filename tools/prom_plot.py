"""Plot what Prometheus scraped: per-node mean GPU utilization and the trainer's loss over the last
minutes, from the HTTP API's /api/v1/query_range, as a PNG (matplotlib: the `plot` extra).

    python tools/prom_plot.py --url http://MONITORING_HOST:9090 --minutes 10 --out docs/monitoring.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

# (PromQL, y label, the label naming each line); mean over a node's GPUs, the trainer's loss per node.
PANELS = (
    ("avg by (node) (ddp_gpu_utilization_percent)", "GPU utilization (%)", "node"),
    ("ddp_train_loss", "training loss", "node"),
)


def query_range(url: str, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """The result of one range query (https://prometheus.io/docs/prometheus/latest/querying/api/#range-queries):
    a list of {"metric": {labels}, "values": [[unix time, "value"], ...]}."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an http(s) URL: {url}")
    params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(  # noqa: S310 (checked above)
            f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=10
        ) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as exc:  # a bad query is a 400 whose JSON body says why
        try:
            body = json.load(exc)
        except ValueError:
            raise ValueError(f"{query}: HTTP {exc.code}") from None
    if body.get("status") != "success":
        raise ValueError(f"{query}: {body.get('error', body)}")
    return list(body["data"]["result"])


def render(panels: list[tuple[str, str, list[dict[str, Any]]]], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, dpi=90)
    for ax, (ylabel, label, series) in zip(axes, panels):
        for s in sorted(series, key=lambda s: s["metric"].get(label, "")):
            xs = [float(t) - start for t, _ in s["values"]]
            ax.plot(xs, [float(v) for _, v in s["values"]], label=s["metric"].get(label, "?"))
        ax.set_ylabel(ylabel)
        if series:
            ax.legend(loc="upper right", fontsize="small")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="Prometheus, e.g. http://10.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=10.0, help="how far back (default 10)")
    ap.add_argument("--step", type=float, default=2.0, help="seconds between points (default 2)")
    ap.add_argument("--out", type=Path, default=Path("monitoring.png"))
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("prom_plot: matplotlib is not installed: pip install 'ddp-train[plot]'", file=sys.stderr)
        return 2
    end = time.time()
    start = end - args.minutes * 60
    panels = []
    try:
        for query, ylabel, label in PANELS:
            panels.append((ylabel, label, query_range(args.url, query, start, end, args.step)))
    except (OSError, ValueError, KeyError) as exc:  # URLError (no server) is an OSError
        print(f"prom_plot: {args.url}: {exc}", file=sys.stderr)
        return 1
    empty = [ylabel for ylabel, _, series in panels if not series]
    if empty:
        print(f"prom_plot: no {' or '.join(empty)} series in the last {args.minutes:g} min", file=sys.stderr)
        return 1
    first = min(float(s["values"][0][0]) for _, _, series in panels for s in series)
    render(panels, first, args.out)
    print(f"prom_plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
