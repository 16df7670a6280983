"""Rank 0's metrics where a person can look at them: logs/<job>/metrics.jsonl and metrics.png.

The monitor copies rank 0's <run dir>/metrics.jsonl (the packaged trainer's; a user script has none
the launcher knows of) from the master node into logs/<job>/ every FETCH_EVERY_S seconds and at the
end of the job. `ddp-launch status` re-reads it (straight from the file when the master is this
machine) and renders logs/<job>/metrics.png: loss and tokens/s against step, with matplotlib (optional
extra: pip install 'ddp-train[plot]'; without it, one line says so).
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import threading
from pathlib import Path
from typing import Any

from ddp_train.launch.jobs.jobstate import PRIVATE_FILE, write_private
from ddp_train.text import install_hint

FETCH_EVERY_S = 30.0
PLOT_HINT = install_hint("matplotlib", "plot")


def rank0(plan: Any) -> Any:
    """The node plan of rank 0: under c10d torchrun orders nodes by --local-addr, so after netif.apply
    it need not be plan.master (the rendezvous host)."""
    return next((p for p in plan.nodes if p.rank == 0), plan.master)


def metrics_location(plan: Any, config: str | None, overrides: Any) -> dict[str, Any] | None:
    """{"host", "path", "local"} of rank 0's metrics.jsonl for the packaged trainer; None otherwise."""
    if plan.script:
        return None
    try:
        from ddp_train.config import ConfigError, load_config

        cfg = load_config(config, list(overrides))
    except (ImportError, ConfigError):
        return None
    if not cfg.log.jsonl:
        return None
    master = rank0(plan)
    run_dir = posixpath.join(cfg.run.dir, cfg.run.name)
    if not posixpath.isabs(run_dir) and not run_dir.startswith("~"):
        run_dir = posixpath.join(master.cwd or ".", run_dir)
    return {
        "host": master.node.name,
        "path": posixpath.join(run_dir, "metrics.jsonl"),
        "local": master.node.local,
    }


class Fetcher:
    """Copies rank 0's metrics into logs/<job>/metrics.jsonl now and then, and once at the end."""

    def __init__(self, where: dict[str, Any], node: Any, dest: Path, connect_timeout: float = 10,
                 earlier: bytes = b"") -> None:  # fmt: skip
        self.where, self.node, self.dest, self.connect_timeout = where, node, dest, connect_timeout
        self.earlier = earlier  # an earlier attempt's copy, whose rank 0 may be gone (launch/run/nodeloss.py)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="metrics", daemon=True)
        self.session: Any = None

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(FETCH_EVERY_S):
            self.fetch()

    def fetch(self) -> bool:
        try:
            if self.where.get("local"):
                src = Path(self.where["path"]).expanduser()
                if not src.is_file():
                    return False
                write_private(self.dest, merged(self.earlier, src.read_bytes()))
                return True
            from ddp_train.launch.remote.remote import open_session

            if self.session is None or not self.session.alive():
                self.session = open_session(self.node, self.connect_timeout)
            code, out = self.session.exec(shlex.join(["cat", "--", self.where["path"]]), timeout=60)
        except Exception:  # noqa: BLE001 - metrics are a convenience: never disturb the job
            return False
        if code != 0 or not out:
            return False
        write_private(self.dest, merged(self.earlier, (out if out.endswith("\n") else out + "\n").encode()))
        return True

    def stop(self) -> None:
        """The final copy; closes the connection."""
        self.stopped.set()
        self.fetch()
        if self.session is not None:
            self.session.close()


def merged(earlier: bytes, new: bytes) -> bytes:
    """An earlier attempt's records before the first step of the new rank 0's file, then that file: after a
    lost master the new one's file starts where it resumed (its own disk) or holds them all (shared)."""
    steps = [r["step"] for r in _records(new)]
    if not steps:
        return earlier + new
    keep = [line for line, r in zip(earlier.splitlines(keepends=True), _records(earlier, keep_bad=True))
            if r is not None and r["step"] < min(steps)]  # fmt: skip
    return b"".join(keep) + new


def _records(data: bytes, keep_bad: bool = False) -> list[Any]:
    """Each line's record (a dict with an int "step"); with keep_bad, None for any other line (a line
    being written), so that the list follows the lines."""
    out: list[Any] = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written, or not UTF-8
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
        elif keep_bad:
            out.append(None)
    return out


def start(plan: Any, config: str | None, overrides: Any, job_dir: Path, connect_timeout: float) -> Any:
    """The monitor's fetcher of rank 0's metrics (None for a user script); job.json records where. A later
    attempt's fetcher keeps the earlier attempts' records in front of the new rank 0's."""
    where = metrics_location(plan, config, overrides)
    if where is None:
        return None
    from ddp_train.launch.jobs import jobstate

    jobstate.update_state(job_dir / jobstate.STATE_FILE, metrics=where)
    dest = job_dir / "metrics.jsonl"
    later = plan.options is not None and plan.options.attempt > 1
    earlier = dest.read_bytes() if later and dest.exists() else b""
    fetcher = Fetcher(where, rank0(plan).node, dest, connect_timeout, earlier)
    fetcher.start()
    return fetcher


def finish(fetcher: Any, job_dir: Path) -> str | None:
    """At the job's end: the last copy of rank 0's metrics and the PNG; a line to log."""
    if fetcher is None:
        return None
    fetcher.stop()
    records = read_records(job_dir / "metrics.jsonl")
    if not records:
        return f"metrics: nothing to fetch from {fetcher.where['host']}:{fetcher.where['path']}"
    return f"metrics: {job_dir / 'metrics.jsonl'} ({len(records)} records); " + render_png(
        records, job_dir / "metrics.png"
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        return [r for r in _records(path.read_bytes()) if r is not None]
    except OSError:
        return []


def render_png(records: list[dict[str, Any]], png: Path) -> str:
    """Loss and tokens/s against step as a small PNG; one line saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot: matplotlib is not installed: {PLOT_HINT}"
    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 4), sharex=True, dpi=80)
    top.plot(steps, [r.get("loss") for r in records], label="loss")
    if any("val_loss" in r for r in records):
        val = [r for r in records if "val_loss" in r]
        top.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val_loss")
    top.set_ylabel("loss")
    top.legend(loc="upper right")
    bottom.plot(steps, [r.get("tokens_per_s") for r in records], color="tab:green")
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("step")
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.chmod(tmp, PRIVATE_FILE)  # the job's files are its owner's only
    tmp.replace(png)
    return f"plot: {png}"


def refresh(job_dir: Path, data: dict[str, Any]) -> list[str]:
    """Update logs/<job>/metrics.jsonl (a local master's file directly) and the PNG; lines to show."""
    where = data.get("metrics")
    dest = job_dir / "metrics.jsonl"
    if where and where.get("local"):
        Fetcher(where, None, dest).fetch()
    records = read_records(dest)
    if not records:
        return [] if not where else [f"metrics: none yet ({where['host']}:{where['path']})"]
    last = records[-1]
    return [
        f"metrics: {dest} ({len(records)} records, last step {last['step']}, from {where and where['host']})",
        render_png(records, job_dir / "metrics.png"),
    ]
