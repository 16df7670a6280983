#!/usr/bin/python3
"""GPU metrics for the Prometheus node exporter's textfile collector, from `nvidia-smi --query-gpu`.

Stdlib only (runs with the node's python3). Every --interval seconds (0: once) it writes one file,
atomically: a temporary file in the same directory (a name node_exporter skips, it reads *.prom only),
flushed, fsynced and renamed over --out. Fields a driver does not know or a GPU does not support
([N/A], [Not Supported]) leave their series out; a failing nvidia-smi writes ddp_gpu_collector_up 0.
Fields: nvidia-smi --help-query-gpu and --help-query-remapped-rows; Xid lines: NVIDIA's Xid catalogue
(https://docs.nvidia.com/deploy/xid-errors/index.html), counted from the kernel log since boot.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time

# (query field, metric, help, scale): one gauge per field, labelled by GPU index and UUID.
FIELDS: tuple[tuple[str, str, str, float], ...] = (
    (
        "utilization.gpu",
        "ddp_gpu_utilization_percent",
        "GPU utilization over the last sample period, percent.",
        1,
    ),
    ("memory.used", "ddp_gpu_memory_used_bytes", "Framebuffer memory in use.", 1024 * 1024),
    ("memory.total", "ddp_gpu_memory_total_bytes", "Framebuffer memory in all.", 1024 * 1024),
    ("power.draw", "ddp_gpu_power_watts", "Power draw.", 1),
    ("temperature.gpu", "ddp_gpu_temperature_celsius", "GPU core temperature.", 1),
    ("clocks.sm", "ddp_gpu_sm_clock_hertz", "SM clock.", 1e6),
    (
        "ecc.errors.corrected.volatile.total",
        "ddp_gpu_ecc_corrected_errors",
        "Corrected ECC errors since the driver loaded.",
        1,
    ),
    (
        "ecc.errors.uncorrected.volatile.total",
        "ddp_gpu_ecc_uncorrected_errors",
        "Uncorrected ECC errors since the driver loaded.",
        1,
    ),
    (
        "retired_pages.single_bit_ecc.count",
        "ddp_gpu_retired_pages_sbe",
        "Pages retired for single-bit ECC errors.",
        1,
    ),
    (
        "retired_pages.double_bit.count",
        "ddp_gpu_retired_pages_dbe",
        "Pages retired for double-bit ECC errors.",
        1,
    ),
)
# The fields every driver since R450 knows: the fallback when the full query names one it does not.
CORE = 6
REMAPPED = (
    (
        "remapped_rows.correctable",
        "ddp_gpu_remapped_rows_correctable",
        "Rows remapped for correctable errors.",
    ),
    (
        "remapped_rows.uncorrectable",
        "ddp_gpu_remapped_rows_uncorrectable",
        "Rows remapped for uncorrectable errors.",
    ),
    (
        "remapped_rows.pending",
        "ddp_gpu_remapped_rows_pending",
        "1 when a row remapping waits for a GPU reset.",
    ),
    ("remapped_rows.failure", "ddp_gpu_remapped_rows_failure", "1 when a row remapping failed."),
)
XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})[^)]*\): (\d+),")


def _num(value: float) -> str:
    """A sample value as Prometheus reads it, exactly (no 6-digit rounding of large byte counts)."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _value(text: str, scale: float = 1) -> float | None:
    text = text.strip()
    if text in ("Yes", "No"):
        return 1.0 if text == "Yes" else 0.0
    try:
        return float(text) * scale
    except ValueError:  # [N/A], [Not Supported], [Unknown Error]
        return None


def _bus(bus_id: str) -> str:
    """'00000000:18:00.0' and the kernel's '0000:18:00' -> '18:00' (domain 0 assumed away)."""
    parts = bus_id.lower().split(":")
    return f"{parts[-2]}:{parts[-1].split('.')[0]}" if len(parts) >= 2 else bus_id.lower()


def _smi(binary: str, query: str, fields: list[str]) -> list[list[str]] | None:
    try:
        res = subprocess.run(
            [binary, f"--{query}={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    rows = [r for r in csv.reader(res.stdout.splitlines(), skipinitialspace=True) if r]
    return [r for r in rows if len(r) == len(fields)]


def xid_counts(kernel_log: str) -> dict[str, int]:
    """Xid events per GPU bus ('18:00') in a kernel log."""
    counts: dict[str, int] = {}
    for m in XID_LINE.finditer(kernel_log):
        bus = f"{m.group(2).lower()}:{m.group(3).lower()}"
        counts[bus] = counts.get(bus, 0) + 1
    return counts


def _kernel_log(dmesg: str) -> str | None:
    try:
        res = subprocess.run([dmesg], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def collect(nvidia_smi: str = "nvidia-smi", dmesg: str = "dmesg") -> str:
    """One textfile's content: every GPU's series, or ddp_gpu_collector_up 0 when nvidia-smi fails."""
    names = [f for f, *_ in FIELDS]
    fields = FIELDS
    rows = _smi(nvidia_smi, "query-gpu", ["index", "uuid", "pci.bus_id", *names])
    if rows is None:
        fields = FIELDS[:CORE]
        rows = _smi(nvidia_smi, "query-gpu", ["index", "uuid", "pci.bus_id", *names[:CORE]])
    series: dict[str, tuple[str, list[str]]] = {}

    def add(metric: str, help_: str, labels: str, value: float) -> None:
        series.setdefault(metric, (help_, []))[1].append(f"{metric}{{{labels}}} {_num(value)}")

    up = rows is not None
    buses: dict[str, str] = {}
    for row in rows or []:
        index, uuid, bus = (c.strip() for c in row[:3])
        labels = f'gpu="{index}",uuid="{uuid}"'
        buses[_bus(bus)] = labels
        for (_, metric, help_, scale), text in zip(fields, row[3:]):
            value = _value(text, scale)
            if value is not None:
                add(metric, help_, labels, value)
    if up and buses:
        remapped = _smi(nvidia_smi, "query-remapped-rows", ["gpu_bus_id", *(f for f, *_ in REMAPPED)])
        for row in remapped or []:
            gpu = buses.get(_bus(row[0]))
            for (_, metric, help_), text in zip(REMAPPED, row[1:]):
                value = _value(text)
                if gpu and value is not None:
                    add(metric, help_, gpu, value)
        log = _kernel_log(dmesg)
        if log is not None:
            counts = xid_counts(log)
            for bus, labels in buses.items():
                add(
                    "ddp_gpu_xid_errors",
                    "Xid events in the kernel log since boot.",
                    labels,
                    counts.get(bus, 0),
                )
    lines = []
    for metric, (help_, samples) in series.items():
        lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge", *samples]
    lines += [
        "# HELP ddp_gpu_collector_up 1 when the last nvidia-smi query succeeded.",
        "# TYPE ddp_gpu_collector_up gauge",
        f"ddp_gpu_collector_up {int(up)}",
        "# HELP ddp_gpu_collector_last_run_timestamp_seconds When the collector last wrote this file.",
        "# TYPE ddp_gpu_collector_last_run_timestamp_seconds gauge",
        f"ddp_gpu_collector_last_run_timestamp_seconds {time.time():.3f}",
    ]
    return "\n".join(lines) + "\n"


def write_atomically(path: str, text: str) -> None:
    """Replace `path` in one rename: node_exporter never reads a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ddp-gpu-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the .prom file in node_exporter's textfile directory")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples; 0: once")
    p.add_argument("--nvidia-smi", default="nvidia-smi")
    p.add_argument("--dmesg", default="dmesg")
    args = p.parse_args(argv)
    while True:
        start = time.monotonic()
        write_atomically(args.out, collect(args.nvidia_smi, args.dmesg))
        if args.interval <= 0:
            return 0
        time.sleep(max(0.0, args.interval - (time.monotonic() - start)))


if __name__ == "__main__":
    sys.exit(main())
