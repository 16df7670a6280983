"""Rank-0 logging, the per-run JSONL metrics file, a TTY progress bar, MFU, and the Prometheus textfile."""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, TextIO

from ddp_train import storage, tbwriter
from ddp_train.config import dump_yaml

LOG_FORMAT = "%(asctime)s ddp-train[rank {rank}] %(levelname)s %(message)s"

# Dense (no sparsity) tensor-core peak per GPU, TFLOP/s, by precision, from NVIDIA's datasheets
# (https://www.nvidia.com/en-us/data-center/h100/, /h200/, /a100/; the sparse figures halved). fp32 means
# TF32 on the tensor cores: the trainer turns TF32 on for CUDA matmuls. First match of the substring in
# torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "fp32": 417.5}),
    ("H200", {"bf16": 989.5, "fp16": 989.5, "fp32": 494.7}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "fp32": 417.5}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 378.0}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "fp32": 494.7}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
)
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = tuple((name, peaks["bf16"]) for name, peaks in PEAK_TFLOPS)


def peak_flops(
    device_name: str, override_tflops: float | None = None, precision: str = "bf16"
) -> float | None:
    """Peak FLOP/s of one device at `precision` (bf16, fp16, fp32 = TF32): the config override, else the
    table, else None (unknown)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks[precision] * 1e12
    return None


def device_peak_flops(device: Any, override_tflops: float | None, precision: str) -> float | None:
    """peak_flops of `device` (a torch.device); None on CPU (no MFU there)."""
    if device.type != "cuda":
        return None
    import torch

    return peak_flops(torch.cuda.get_device_name(device), override_tflops, precision)


def mfu(tokens_per_s: float, flops_per_token: float, peak_per_device: float, world_size: int) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_per_token / (peak_per_device * world_size)


class ProgressBar:
    """A one-line bar redrawn in place on a TTY (no dependency); silent when disabled."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream or sys.stderr
        self._drawn = False

    def update(self, step: int, text: str = "") -> None:
        if not self.enabled:
            return
        done = int(self.width * step / max(1, self.total))
        bar = "#" * done + "." * (self.width - done)
        self.stream.write(f"\r\x1b[K[{bar}] {step}/{self.total} {text}")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


class _BarAwareHandler(logging.StreamHandler):
    """Clears the progress bar before a log line so the two never share a line."""

    bar: ProgressBar | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is not None:
            self.bar.clear()
        super().emit(record)


def setup_logging(rank: int, level: str = "info") -> logging.Logger:
    """The `ddp_train` logger: `level` on rank 0, warnings and errors only elsewhere, one format."""
    logger = logging.getLogger("ddp_train")
    for h in list(logger.handlers):
        if isinstance(h, _BarAwareHandler):
            logger.removeHandler(h)
    handler = _BarAwareHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def attach_progress_bar(logger: logging.Logger, bar: ProgressBar) -> None:
    """Let log lines clear `bar` first."""
    for h in logger.handlers:
        if isinstance(h, _BarAwareHandler):
            h.bar = bar


def open_outputs(cfg: Any, is_main: bool, logger: logging.Logger) -> tuple[ProgressBar, Any]:
    """A run's progress bar (log lines clear it first) and metrics writer: metrics.jsonl on rank 0 when
    log.jsonl, plus TensorBoard when log.tensorboard (tbwriter.tee); rank 0 writes the run's
    config.yaml."""
    show = cfg.log.progress == "always" or (cfg.log.progress == "auto" and sys.stderr.isatty())
    bar = ProgressBar(cfg.train.max_steps, show and is_main)
    attach_progress_bar(logger, bar)
    path = cfg.run_dir / "metrics.jsonl"
    with storage.guarded("opening the metrics file", path):
        writer = JsonlWriter(path if is_main and cfg.log.jsonl else None)
    writer = tbwriter.tee(writer, cfg, is_main)
    if is_main and cfg.log.prometheus:
        writer = PromTextfile(writer, Path(cfg.log.prometheus_textfile), cfg.run_dir.name)
    if is_main:
        config = cfg.run_dir / "config.yaml"
        with (
            storage.guarded("writing the run's config", config),
            storage.open_output(config, encoding="utf-8") as f,  # never through a link
        ):
            f.write(dump_yaml(cfg))
    return bar, writer


class JsonlWriter:
    """Appends one JSON object per line to a run's metrics file, flushed after every record."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f: IO[Any] | None = None
        if path is not None:
            storage.own_dir(path.parent)
            self._f = storage.open_output(path, "a", encoding="utf-8")  # kept open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None and self.path is not None:
            with storage.guarded("writing metrics", self.path):
                self._f.write(json.dumps(record, sort_keys=False) + "\n")
                self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _user_name() -> str:
    """The name of the user this process runs as (the file's owner), not $USER."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return str(os.geteuid())


def _file_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "_"


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# The step record's fields log.prometheus exposes: (record key, metric, help).
PROM_FIELDS = (
    ("step", "ddp_train_step", "The latest optimizer step rank 0 reported."),
    ("loss", "ddp_train_loss", "Training loss at that step (mean over ranks)."),
    ("val_loss", "ddp_train_val_loss", "The latest validation loss."),
    ("tokens_per_s", "ddp_train_tokens_per_second", "Training tokens/s over the last log interval."),
    (
        "wall_tokens_per_s",
        "ddp_train_wall_tokens_per_second",
        "Tokens/s on the wall clock (evals, saves in).",
    ),
    ("mfu", "ddp_train_mfu_ratio", "Model FLOPs utilisation over the last log interval."),
    ("wall_mfu", "ddp_train_wall_mfu_ratio", "Model FLOPs utilisation on the wall clock (evals, saves in)."),
)


class PromTextfile:
    """Rank 0's latest step metrics in a node exporter textfile (log.prometheus), replaced atomically at
    every record (temporary file in the same directory, rename): node_exporter serves the file on its
    own port; the trainer opens none. val_loss keeps its last value between evaluations."""

    def __init__(self, inner: Any, path: Path, run: str) -> None:
        user = _user_name()
        # {user} and {run} in the path: one file per user and run. In the shared textfile directory
        # (setgid + sticky, monitoring_textfile_writers_group) one user cannot replace another's file,
        # and two files with the same series make node_exporter report neither.
        self.inner = inner
        self.path = Path(str(path).replace("{user}", _file_part(user)).replace("{run}", _file_part(run)))
        self.labels = f'run="{_label_value(run)}",user="{_label_value(user)}"'
        self.values: dict[str, float] = {}
        try:
            self._replace()
        except OSError as exc:  # before the first step: one line naming the setting, not a traceback
            from ddp_train.config import ConfigError

            raise ConfigError(
                "config", "log.prometheus_textfile",
                f"cannot write {path}: {exc.strerror or exc}; it must be in a directory this user can write "
                "(the monitoring role's textfile directory is)",
            ) from exc  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        self.inner.write(record)
        for key, *_ in PROM_FIELDS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.values[key] = float(value)
        with storage.guarded("writing the Prometheus textfile", self.path):
            self._replace()

    def _replace(self) -> None:
        lines = []
        for key, metric, help_ in PROM_FIELDS:
            if key in self.values:
                lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge"]
                lines.append(f"{metric}{{{self.labels}}} {self.values[key]!r}")
        lines += [
            "# HELP ddp_train_last_update_timestamp_seconds When rank 0 last wrote this file.",
            "# TYPE ddp_train_last_update_timestamp_seconds gauge",
            f"ddp_train_last_update_timestamp_seconds{{{self.labels}}} {time.time():.3f}",
        ]
        fd, tmp = tempfile.mkstemp(prefix=".ddp-train-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

    def close(self) -> None:
        self.inner.close()
