"""TensorBoard event files next to metrics.jsonl, when `log.tensorboard: true` (off by default).

`tee(jsonl, cfg, is_main)` returns the JSONL writer itself unless TensorBoard is asked for, so a run
without it imports nothing more. With it, every metrics record also goes to a SummaryWriter
(torch.utils.tensorboard, which needs the `tensorboard` package: pip install 'ddp-train[tensorboard]')
in <run dir>/tensorboard/, one scalar per numeric field, tagged train/<field> (val/<field> for val_*).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ddp_train.text import install_hint

INSTALL_HINT = install_hint("tensorboard", "tensorboard")


class _Tee:
    def __init__(self, jsonl: Any, summary: Any) -> None:
        self.jsonl, self.summary = jsonl, summary

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        step = int(record.get("step") or 0)
        for key, value in record.items():
            if key in ("step", "epoch") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            self.summary.add_scalar(tag, value, step)
        self.summary.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.summary.close()


def tee(jsonl: Any, cfg: Any, is_main: bool) -> Any:
    """The metrics writer of a run: the JSONL writer, plus TensorBoard on rank 0 when asked."""
    if not getattr(cfg.log, "tensorboard", False):
        return jsonl
    # Checked on every rank, not only where it is used: rank 0 alone exiting would leave the others
    # waiting in their first all-reduce until the collective timeout.
    if importlib.util.find_spec("tensorboard") is None:
        from ddp_train.config import ConfigError

        raise ConfigError("config", "log.tensorboard", f"needs the tensorboard package: {INSTALL_HINT}")
    if not is_main:
        return jsonl
    from torch.utils.tensorboard import SummaryWriter

    from ddp_train import storage

    log_dir = cfg.run_dir / "tensorboard"
    storage.own_dir(log_dir)  # SummaryWriter opens its files plainly: nobody else may put links there
    return _Tee(jsonl, SummaryWriter(log_dir=str(log_dir)))
