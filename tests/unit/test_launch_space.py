"""#32 item 4: preflight checks that rank 0's node has room for two checkpoints and best.pt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train.config import load_config
from ddp_train.launch.plan.plan import Options, build_plan
from ddp_train.launch.preflight.preflight import NodeCheck, checkpoint_bytes
from tests.integration.test_failures_disk import tmpfs
from tests.unit.test_launch_plan import node


class LocalSession:
    """Runs a command here, as a local node's session does."""

    def exec(self, cmd: str, timeout: float) -> tuple[int, str]:
        res = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        return res.returncode, res.stdout + res.stderr


def check(tmp_path: Path, run_dir: Path, strict: bool) -> NodeCheck:
    from ddp_train.launch.preflight.preflight import check_space  # new in #32

    plan = build_plan([node("n0", "10.0.0.1", venv=sys.prefix)], Options(job_id="j"))
    c = NodeCheck(plan.nodes[0], session=LocalSession(), facts={"python": "3"})  # type: ignore[arg-type]
    check_space([c], load_config(None, [f"run.dir={run_dir}"]), strict)
    return c


def test_estimate_is_weights_times_three_under_adamw_and_best_pt_the_weights() -> None:
    cfg = load_config(None, [])
    ckpt, best = checkpoint_bytes(cfg)
    assert best == 21768 * 4 + 65536  # the default MLP's parameters in fp32 (the trainer's "params=21768")
    assert ckpt == 3 * 21768 * 4 + 65536  # weights + AdamW's exp_avg and exp_avg_sq
    assert checkpoint_bytes(load_config(None, ["train.optimizer=sgd", "train.momentum=0"]))[0] == best


@pytest.mark.slow
def test_a_built_in_models_size_is_remembered_so_the_next_launch_does_not_import_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = checkpoint_bytes(load_config(None, []))
    cache = tmp_path / "ddp-train" / "model-bytes.json"
    assert (cache.stat().st_mode & 0o777, cache.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    probe = (
        "import json, sys; from ddp_train.config import load_config; "
        "from ddp_train.launch.preflight.preflight import checkpoint_bytes; "
        "print(json.dumps([checkpoint_bytes(load_config(None, sys.argv[1:])), 'torch' in sys.modules]))"
    )

    def launch(*overrides: str) -> list:
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
        out = subprocess.run(
            [sys.executable, "-c", probe, *overrides], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert launch() == [list(first), False]  # remembered: torch not imported
    wider = launch("model.mlp.hidden_dim=256")  # another model: built (torch imported), then remembered
    assert wider[1] is True and wider[0][1] > first[1]
    assert launch("model.mlp.hidden_dim=256") == [wider[0], False]
    cache.write_text("{not json")  # a damaged cache is rebuilt, never an error
    assert launch() == [list(first), True]


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounts a tmpfs")
def test_a_small_run_dir_is_a_warning_naming_it_and_a_failure_with_strict(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=256k") as small:
        c = check(tmp_path, small, strict=False)
        assert c.failures == [] and len(c.warnings) == 1, c.warnings
        warning = c.warnings[0]
        assert warning.startswith(
            f"{small}/default/checkpoints, {small}/default ({small}): 256.0 KiB free"
        ), warning
        # best.pt counted as a whole checkpoint: a hard link that outlived the checkpoint's rotation
        need = "less than two checkpoints and best.pt need (957.3 KiB: 319.1 KiB per checkpoint, 319.1 KiB"
        assert need in warning, warning
        strict = check(tmp_path, small, strict=True)
        assert strict.failures == [warning] and strict.warnings == []
    assert check(tmp_path, tmp_path / "roomy", strict=True).failures == []
