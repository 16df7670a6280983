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

# Panels: (y label, [(PromQL, what the line is)]); {run} is the --run selector. Mean and min over each
# node's GPUs (the least busy GPU is what `ddp-launch status` flags), the trainer's loss per node.
PANELS = (
    (
        "GPU utilization (%)",
        [
            ("avg by (node) (ddp_gpu_utilization_percent)", "mean"),
            ("min by (node) (ddp_gpu_utilization_percent)", "min"),
        ],
    ),
    ("training loss", [("ddp_train_loss{run}", "")]),
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


def line_name(metric: dict[str, str], what: str) -> str:
    """node0 mean, node1 min, node0 run=r1: the node, what the line is, and the trainer's run."""
    run = f"run={metric['run']}" if "run" in metric else ""
    return " ".join(x for x in (metric.get("node", "?"), what, run) if x)


def render(panels: list[tuple[str, list[tuple[str, dict[str, Any]]]]], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, dpi=90)
    for ax, (ylabel, series) in zip(axes, panels):
        for what, s in sorted(series, key=lambda ws: (ws[1]["metric"].get("node", ""), ws[0])):
            xs = [float(t) - start for t, _ in s["values"]]
            style = "--" if what == "min" else "-"
            ax.plot(xs, [float(v) for _, v in s["values"]], style, label=line_name(s["metric"], what))
        ax.set_ylabel(ylabel)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="Prometheus, e.g. http://10.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=10.0, help="how far back (default 10)")
    ap.add_argument("--step", type=float, default=2.0, help="seconds between points (default 2)")
    ap.add_argument("--run", help="only this training run's loss (log.prometheus' label run, the run name)")
    ap.add_argument("--out", type=Path, default=Path("monitoring.png"))
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("prom_plot: matplotlib is not installed: pip install 'ddp-train[plot]'", file=sys.stderr)
        return 2
    end = time.time()
    start = end - args.minutes * 60
    run = "{run=" + json.dumps(args.run) + "}" if args.run else ""  # a JSON string is a PromQL string
    panels = []
    try:
        for ylabel, queries in PANELS:
            series = []
            for query, what in queries:
                found = query_range(args.url, query.replace("{run}", run), start, end, args.step)
                series += [(what, s) for s in found]
            panels.append((ylabel, series))
    except (OSError, ValueError, KeyError) as exc:  # URLError (no server) is an OSError
        print(f"prom_plot: {args.url}: {exc}", file=sys.stderr)
        return 1
    empty = [ylabel for ylabel, series in panels if not series]
    if empty:
        print(f"prom_plot: no {' or '.join(empty)} series in the last {args.minutes:g} min", file=sys.stderr)
        return 1
    first = min(float(s["values"][0][0]) for _, series in panels for _, s in series)
    render(panels, first, args.out)
    print(f"prom_plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
