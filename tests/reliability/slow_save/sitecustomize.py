"""Test shim (PYTHONPATH, tests/reliability only): a checkpoint writer slow enough to be killed mid-write.

In trainer workers (RANK set) with RL_SLOW_SAVE_STEP=N, torch.save into `step-<N>.pt.tmp` writes the
serialized bytes in RL_SLOW_SAVE_CHUNKS chunks, flushing and pausing between them, and reports
"pid written total path" in the file RL_SLOW_SAVE_REPORT, so a test can SIGKILL the writer while the
file on disk is truncated.
"""

import os

if os.environ.get("RL_SLOW_SAVE_STEP") and "RANK" in os.environ:
    import io
    import time

    import torch

    _step = int(os.environ["RL_SLOW_SAVE_STEP"])
    _chunks = int(os.environ.get("RL_SLOW_SAVE_CHUNKS", "20"))
    _pause = float(os.environ.get("RL_SLOW_SAVE_PAUSE_S", "0.5"))
    _report = os.environ["RL_SLOW_SAVE_REPORT"]
    _original_save = torch.save

    def _slow_save(obj, f, *args, **kwargs):
        name = getattr(f, "name", "")
        if not (isinstance(name, str) and name.endswith(f"step-{_step:08d}.pt.tmp")):
            return _original_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        _original_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        size = -(-len(data) // _chunks)
        written = 0
        for start in range(0, len(data), size):
            f.write(data[start : start + size])
            f.flush()
            os.fsync(f.fileno())
            written += len(data[start : start + size])
            with open(_report + ".tmp", "w") as p:
                p.write(f"{os.getpid()} {written} {len(data)} {name}\n")
            os.replace(_report + ".tmp", _report)
            time.sleep(_pause)
        return None

    torch.save = _slow_save
