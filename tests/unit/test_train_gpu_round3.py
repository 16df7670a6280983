"""Issue #46 on CPU: DDP's bucket size from the config, MFU on the wall clock beside the compute-only one
(step line, metrics.jsonl, the run's throughput line, the launcher's live line and summary)."""

from __future__ import annotations

import torch

from ddp_train.launch.run import progress, trainerlog


def test_dist_bucket_cap_mb_sizes_ddps_gradient_buckets(tmp_path):
    """dist.bucket_cap_mb reaches DDP (issue #46; torch's default 25 stays the config's)."""
    import torch.distributed as dist

    from ddp_train import distributed
    from ddp_train.config import load_config

    assert load_config(None, []).dist.bucket_cap_mb == 25
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", world_size=1, rank=0)
    try:
        env = distributed.DistEnv(world_size=2, distributed=True)  # DDP is skipped for a world of one
        ddp = distributed.wrap(torch.nn.Linear(4, 4), env, torch.device("cpu"), bucket_cap_mb=5)
        assert ddp.bucket_bytes_cap == 5 * 2**20
    finally:
        dist.destroy_process_group()


def test_the_step_line_and_the_records_carry_mfu_on_the_wall_clock(tmp_path, monkeypatch, capsys):
    from test_train_loop import metrics, train

    from ddp_train import trainer

    # a CPU has no peak: 10 GFLOP/s here, so that the one-decimal percentages of the lines stay well above
    # 0.0% on a loaded machine (~95% idle here, ~5% at 736 tok/s; at 1 TFLOP/s a loaded run printed 0.0%)
    monkeypatch.setattr(trainer, "device_peak_flops", lambda *_: 1e10)
    code, _ = train(tmp_path, "model.name=gpt", "train.max_steps=4", "log.interval_steps=2")
    assert code == 0
    recs = [r for r in metrics(tmp_path) if "mfu" in r]
    assert len(recs) == 2 and all(0 < r["wall_mfu"] <= r["mfu"] for r in recs)  # wall time >= compute time
    lines = capsys.readouterr().err.splitlines()
    step = trainerlog.parse_step(next(x for x in lines if "INFO step 4/4 " in x))
    assert step is not None and abs(step.wall_mfu - recs[-1]["wall_mfu"] * 100) <= 0.051
    total = trainerlog.parse_throughput(lines)
    assert total is not None and 0 < total["wall_mfu"] <= total["mfu"]


def test_the_launcher_reads_the_wall_figures_and_shows_them_live():
    line = (
        "12:00:01 ddp-train[rank 0] INFO step 12/30 loss 1.2345 lr 0.001 1234 tok/s 0.123 s/step mfu 38.0% "
        "wall 1100 tok/s mfu 34.5%"
    )
    step = trainerlog.parse_step(line)
    assert step is not None and (step.wall_tokens_per_s, step.mfu, step.wall_mfu) == (1100.0, 38.0, 34.5)
    assert progress.live_line(step).startswith("step 12/30 loss 1.2345 1100 tok/s mfu 34.5% ETA ")
    old = trainerlog.parse_step(line.split(" wall ")[0])  # a trainer line from before: compute-only
    assert old is not None and progress.live_line(old).startswith("step 12/30 loss 1.2345 1234 tok/s ETA ")
    total = (
        "ddp-train[rank 0] INFO throughput: 40 steps in 31.2s wall: 2626 tok/s wall-clock, 2632 tok/s "
        "compute-only (0.1s of eval, checkpoints and delays paused out); "
        "mfu 30.1% wall-clock, 31.0% compute-only"
    )
    assert trainerlog.parse_throughput([total]) == {
        "steps": 40, "wall_s": 31.2, "wall_tokens_per_s": 2626.0, "tokens_per_s": 2632.0,
        "wall_mfu": 30.1, "mfu": 31.0,
    }  # fmt: skip
