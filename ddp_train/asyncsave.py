"""Checkpoints written off the training path (issue #46): rank 0 copies the state to host memory, and a
thread writes, fsyncs, renames, prunes and replicates it while training goes on.

On the 124M config a full checkpoint is ~1.5 GB (weights and AdamW's two moments); written in the step
(a pageable device-to-host copy, the zip's CRC32, fsync) every rank waits for it. Here the step waits only
for the copy: into host buffers that are kept from one save to the next (pinned when the tensors live on
a GPU, so the copies run as DMA, `non_blocking`, then one synchronize), then the write runs in a thread.

- At most one save in flight: the next save, and the run's end or stop (Checkpointer.finish), wait for
  it first; the buffers are reused only after that.
- A failed background save is never silent: its error is raised at that wait, on rank 0, which tells the
  others through the store as a synchronous failure would (checkpoint.Checkpointer).
- Tensors that are one object in the state (GPT's tied embedding and output weights) stay one object in
  the copy, so the file keeps one storage for them, as torch.save of the live state would.
- A rank that fails while a save is in flight lets it end first (Checkpointer.drain, in the loop's
  `finally`): a rank of a multi-rank run exits with os._exit, which would cut the thread off.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch


class HostSnapshot:
    """Copies a state's tensors into host buffers it keeps for the next copy of the same shape."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def copy(self, state: Any) -> Any:
        """`state` with every tensor replaced by a host copy (same identity structure); other values are
        deep-copied. Returns once every copy has landed."""
        memo: dict[tuple, torch.Tensor] = {}
        index = [0]
        on_gpu = [False]

        def host(t: torch.Tensor) -> torch.Tensor:
            # the same view of the same storage is one tensor: state_dict() gives GPT's tied embedding
            # and output weights as two detached objects over one storage, which torch.save writes once
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride())
            if key in memo:
                return memo[key]
            src = t.detach()
            i = index[0]
            index[0] += 1
            buf = self.buffers[i] if i < len(self.buffers) else None
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                pin = src.device.type == "cuda"
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
                if i < len(self.buffers):
                    self.buffers[i] = buf
                else:
                    self.buffers.append(buf)
            if src.device.type == "cuda":
                on_gpu[0] = True
                buf.copy_(src, non_blocking=True)
            else:
                buf.copy_(src)
            memo[key] = buf
            return buf

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return host(obj)
            if isinstance(obj, dict):
                out = obj.copy()  # keeps the type (the OrderedDict of a state_dict)
                for k, v in obj.items():
                    out[k] = walk(v)
                if hasattr(obj, "_metadata"):  # a state_dict's module versions: torch.save pickles them
                    out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
                return out
            if isinstance(obj, list):
                return [walk(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(walk(v) for v in obj)
            return copy.deepcopy(obj)

        out = walk(state)
        del self.buffers[index[0] :]  # a smaller state than last time: free what it no longer needs
        if on_gpu[0]:
            torch.cuda.synchronize()  # the non_blocking copies have landed before training touches the source
        return out


class BackgroundSave:
    """One save at a time in a thread of its own; its error is raised by the next wait()."""

    def __init__(self) -> None:
        self.snapshot = HostSnapshot()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], None], name: str) -> None:
        """Run write() in the background; the previous save must have been waited for."""
        assert not self.busy, "a save is still in flight: wait() first"

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - kept, and raised on the training thread
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"ddp-save {name}", daemon=False)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the save in flight (if any) has ended, or `timeout_s` passed (then False); re-raises its
        error once."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True
