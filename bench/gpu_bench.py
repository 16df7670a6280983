"""GPU checks for one lent H200 (issue 7), each printing one ratio line; `--smoke` runs them on CPU.

    python bench/gpu_bench.py matmul            # G1 bf16 matmul 8192^3 TFLOP/s vs the device's peak
    python bench/gpu_bench.py trainer-vs-minimal  # G2 our trainer vs a nanoGPT-style loop, GPT-124M, wall
    torchrun --standalone --nproc-per-node 1 bench/gpu_bench.py ddp-vs-bare   # G3 DDP(ws=1, nccl) vs bare
    python bench/gpu_bench.py stats-sync        # G4 step time: .tolist() of the stats every step vs StepMeter
    python bench/gpu_bench.py loader            # G5 loader-alone tokens/s (workers 0 / N) vs the trainer's
    python bench/gpu_bench.py logits-memory     # G6 peak memory of a step: logits.float() copy vs none
    torchrun --standalone --nproc-per-node 1 bench/gpu_bench.py grad-memory   # G7 DDP grads set_to_none
    python bench/gpu_bench.py eval-timing       # G8 compute-only tokens/s with eval every 10 vs none
    python bench/gpu_bench.py checkpoint-cost   # G9 wall time with a save every 25 steps vs none

bench/gpu.sh runs them in parts of a few minutes each (bench/README.md: the GPU runs). Same model,
batch, precision and compile setting on both sides of every ratio; throughput is the median over timed
steps after warm-up (and compilation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]  # ddp_train from this tree: not installed on the GPU image
from common import ratio_line  # noqa: E402

from ddp_train import data, models  # noqa: E402
from ddp_train.config import load_config  # noqa: E402
from ddp_train.data import (  # noqa: E402
    ShardedBatches,
    TokenFile,
    build_dataset,  # noqa: E402
)
from ddp_train.meter import StepMeter  # noqa: E402
from ddp_train.metrics import JsonlWriter, ProgressBar, mfu, peak_flops  # noqa: E402
from ddp_train.models import build_model, flops_per_token  # noqa: E402
from ddp_train.optim import build_optimizer  # noqa: E402

# one micro-batch of 16 a step on each rank, not the config's global batch of 512 (32 micro-batches a step
# on one GPU): the bench times steps of a known size
GPU_SETS = ["train.global_batch=null", "train.batch_size=16", "train.grad_accum_steps=1"]
SMOKE_SETS = [
    "model.gpt.n_layer=2",
    "model.gpt.n_head=2",
    "model.gpt.n_embd=64",
    "model.gpt.block_size=64",
    "model.gpt.vocab_size=256",
    "train.global_batch=null",
    "train.batch_size=4",
    "train.grad_accum_steps=1",
    "train.precision=fp32",
    "train.compile=false",
    "data.synthetic.num_samples=256",
    "data.num_workers=1",
]


def bench_config(smoke: bool):
    return load_config(
        str(REPO / "ddp_train" / "configs" / "gpt2-124m.yaml"), SMOKE_SETS if smoke else GPU_SETS
    )


def device() -> torch.device:
    return (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_peak(dev: torch.device) -> float | None:
    return peak_flops(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None


def cmd_matmul(a: argparse.Namespace) -> None:
    dev = device()
    n = 1024 if a.smoke else 8192
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(n, n, device=dev, dtype=dtype)
    y = torch.randn(n, n, device=dev, dtype=dtype)
    times = []
    for i in range(5 + (3 if a.smoke else 30)):
        sync(dev)
        t0 = time.perf_counter()
        x @ y
        sync(dev)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    tflops = 2 * n**3 / statistics.median(times) / 1e12
    peak = device_peak(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"matmul {n}^3 {dtype} on {name}: {tflops:.1f} TFLOP/s (median of {len(times)})")
    ratio = tflops * 1e12 / peak if peak else float("nan")
    print(ratio_line("G1", "matmul_bf16/peak", "tflops", ratio, tflops=f"{tflops:.1f}", n=n))


def minimal_loop(cfg, steps: int, warmup: int) -> tuple[float, float]:
    """nanoGPT's train.py loop, nothing else: (tokens/s, wall seconds) of `steps` steps after `warmup`,
    timed with one device sync before and one after (nanoGPT syncs only to log). The next batch is
    assembled while the device runs the current step, as nanoGPT's get_batch after the forward."""
    dev = device()
    torch.manual_seed(cfg.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = build_model(cfg).to(dev)
    opt = build_optimizer(model, cfg.train, dev)
    fwd = torch.compile(model) if cfg.train.compile else model
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda" and cfg.train.precision == "bf16"
        else contextlib.nullcontext()
    )
    data = build_dataset(cfg)
    bs, t = cfg.train.batch_size, cfg.model.gpt.block_size
    g = torch.Generator().manual_seed(cfg.seed)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(data), (bs,), generator=g).tolist()
        x = torch.stack([data[i][0] for i in idx])
        y = torch.stack([data[i][1] for i in idx])
        if dev.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    x, y = get_batch()
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            sync(dev)
            t0 = time.perf_counter()
        with amp:
            loss = fwd(x, y)
        x, y = get_batch()  # while the device runs the forward
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(dev)
    wall = time.perf_counter() - t0
    return steps * bs * t / wall, wall


def trainer_records(cfg_sets: list[str], steps: int, log_every: int = 5) -> list[dict]:
    """Our trainer under torchrun (1 process) for `steps` steps: its metrics.jsonl records."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        sets = [
            "checkpoint.interval_steps=0",
            "checkpoint.at_end=false",  # no ~1.5 GB write of weights nobody keeps at each run's end
            *cfg_sets,
            f"train.max_steps={steps}",
            f"log.interval_steps={log_every}",
            "checkpoint.resume=never",
            "log.progress=never",
            f"run.dir={tmp}",
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "ddp_train",
            "--config",
            str(REPO / "ddp_train" / "configs" / "gpt2-124m.yaml"),
            *[x for s in sets for x in ("--set", s)],
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
        if res.returncode != 0:
            sys.exit(
                f"gpu_bench: trainer failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
            )
        return [json.loads(x) for x in (Path(tmp) / "gpt2-124m" / "metrics.jsonl").read_text().splitlines()]


def trainer_run(cfg_sets: list[str], steps: int, smoke: bool) -> tuple[float, float | None]:
    """Our trainer: median tokens/s and MFU of the logged windows after warm-up."""
    recs = trainer_records(cfg_sets, steps)
    recs = recs[2:] if len(recs) > 3 else recs[1:]  # the first windows include compilation
    mfus = [r["mfu"] for r in recs if "mfu" in r]
    return statistics.median(r["tokens_per_s"] for r in recs), statistics.median(mfus) if mfus else None


def window(r: dict, every: int) -> tuple[float, float]:
    """(tokens, wall seconds) of one logged window of `every` steps."""
    tokens = r["tokens_per_s"] * r["step_time_s"] * every
    return tokens, tokens / r["wall_tokens_per_s"]


def timed_wall(recs: list[dict], warmup: int, every: int) -> tuple[float, float]:
    """Wall-clock tokens/s and wall seconds of the windows after `warmup` steps (compilation left out)."""
    timed = [window(r, every) for r in recs if r["step"] > warmup]
    wall = sum(w for _, w in timed)
    return sum(t for t, _ in timed) / wall, wall


def cmd_trainer_vs_minimal(a: argparse.Namespace) -> None:
    """G2 (issue 31 item 10): the same N steps on both sides after the same warm-up, wall-clock. The
    trainer without eval or best.pt (nothing paused out, so its wall and compute figures agree) and
    its wall-clock windows summed over the timed steps; the nanoGPT-style loop timed with one sync
    at the end. Also the first window's wall time (compilation) against dist.compile_timeout_s."""
    cfg = bench_config(a.smoke)
    steps, warmup = (10, 5) if a.smoke else (40, 10)
    sets = [*(SMOKE_SETS if a.smoke else GPU_SETS), "eval.interval_steps=0", "eval.keep_best=false"]
    every = 5  # warm-up and timed steps are whole windows of 5 logged steps
    recs = trainer_records(sets, warmup + steps, log_every=every)
    ours_tok, ours_wall = timed_wall(recs, warmup, every)
    ours_compute = statistics.median(r["tokens_per_s"] for r in recs if r["step"] > warmup)
    mfus = [r["mfu"] for r in recs if r["step"] > warmup and "mfu" in r]
    ours_mfu = statistics.median(mfus) if mfus else None
    first_s = window(recs[0], every)[1]
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base_tok, base_wall = minimal_loop(cfg, steps, warmup)
    dev = device()
    peak = device_peak(dev)
    model = build_model(cfg)
    base_mfu = mfu(base_tok, flops_per_token(model), peak, 1) if peak else None
    fmt = lambda v: f"{v:.1%}" if v is not None else "n/a"  # noqa: E731
    print(
        f"{steps} steps after {warmup}: trainer {ours_wall:.2f} s wall, {ours_tok:.0f} tok/s wall-clock "
        f"({ours_compute:.0f} compute-only) mfu {fmt(ours_mfu)}; minimal {base_wall:.2f} s, "
        f"{base_tok:.0f} tok/s mfu {fmt(base_mfu)}; trainer's first 5 steps (compilation) {first_s:.1f} s "
        f"of dist.compile_timeout_s {cfg.dist.compile_timeout_s:.0f}"
    )
    print(
        ratio_line(
            "G2",
            "trainer/minimal_loop",
            "wall_tokens_s",
            ours_tok / base_tok,
            mfu=fmt(ours_mfu),
            minimal_mfu=fmt(base_mfu),
            tokens_s=f"{ours_tok:.0f}",
            wall_s=f"{ours_wall:.2f}",
            minimal_wall_s=f"{base_wall:.2f}",
            first_window_s=f"{first_s:.1f}",
        )
    )


def cmd_eval_timing(a: argparse.Namespace) -> None:
    """G8: issue 31 item 2. The trainer's compute-only tokens/s with eval every 10 steps against eval
    off (best.pt off on both sides, eager: eval's timing, not compilation): ~1.0 when eval's pause
    holds eval only; before the fix eval's clock started while the GPU still ran the step before it,
    so that step left the figure (~1.11). The wall-clock figures show what eval really costs."""
    steps, warmup = (10, 5) if a.smoke else (40, 10)
    base = [*(SMOKE_SETS if a.smoke else GPU_SETS), "train.compile=false", "eval.keep_best=false"]
    out = {}
    for name, every in (("eval", 10), ("no_eval", 0)):
        recs = [
            r
            for r in trainer_records([*base, f"eval.interval_steps={every}"], warmup + steps)
            if r["step"] > warmup
        ]
        out[name] = (
            statistics.median(r["tokens_per_s"] for r in recs),
            statistics.median(r["wall_tokens_per_s"] for r in recs),
        )
    (ev, ev_wall), (no, no_wall) = out["eval"], out["no_eval"]
    print(
        f"compute-only tokens/s: eval every 10 steps {ev:.0f}, no eval {no:.0f}; wall-clock {ev_wall:.0f} "
        f"and {no_wall:.0f}"
    )
    print(
        ratio_line("G8", "eval10/no_eval", "compute_tokens_s", ev / no, wall_ratio=f"{ev_wall / no_wall:.3f}")
    )


def cmd_checkpoint_cost(a: argparse.Namespace) -> None:
    """G9 (issue #46): the wall-clock cost of periodic checkpoints (weights + AdamW moments, ~1.5 GB on
    GPT-124M): the same timed steps with a save every `every` steps, written in a thread after a pinned
    copy (checkpoint.async_save, the default) and in the step (async_save=false), against none. Wall
    seconds of the windows after warm-up (compilation out); `per_250` scales the async cost to the
    issue's one save every 250 steps (cost per save x saves): the target is < 1.02."""
    steps, warmup, every = (20, 5, 6) if a.smoke else (100, 10, 25)
    saves = sum(1 for s in range(warmup + 1, warmup + steps + 1) if s % every == 0)  # in timed windows
    base = [*(SMOKE_SETS if a.smoke else GPU_SETS), "eval.interval_steps=0", "eval.keep_best=false"]
    modes = {
        "none": ["checkpoint.interval_steps=0"],
        "async": [f"checkpoint.interval_steps={every}", "checkpoint.async_save=true"],
        "sync": [f"checkpoint.interval_steps={every}", "checkpoint.async_save=false"],
    }
    wall = {}
    for mode, extra in modes.items():
        _, wall[mode] = timed_wall(trainer_records([*base, *extra], warmup + steps), warmup, 5)
        print(f"checkpoint-cost {mode}: {steps} steps after {warmup} in {wall[mode]:.2f} s wall", flush=True)
    asy, syn, none = wall["async"] / wall["none"], wall["sync"] / wall["none"], wall["none"]
    per_save = (wall["async"] - none) / saves
    print(
        ratio_line(
            "G9",
            "ckpt_async/no_ckpt",
            "wall_s",
            asy,
            sync_ratio=f"{syn:.3f}",
            per_250=f"{1 + per_save / (none / steps * 250):.3f}",
            every=every,
            none_s=f"{none:.2f}",
        )
    )


def cmd_ddp_vs_bare(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = device()
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cfg = bench_config(a.smoke)
    cfg.train.compile = False  # compare the wrappers, not compilation
    steps, warmup = (5, 2) if a.smoke else (30, 5)
    results = {}
    for mode in ("bare", "ddp", "bare2", "ddp2"):  # ABAB against drift
        torch.manual_seed(cfg.seed)
        model = build_model(cfg).to(dev)
        net = (
            DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
            if mode.startswith("ddp")
            else model
        )
        opt = build_optimizer(model, cfg.train, dev)
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
        x = torch.randint(
            cfg.model.gpt.vocab_size, (cfg.train.batch_size, cfg.model.gpt.block_size), device=dev
        )
        times = []
        for i in range(warmup + steps):
            sync(dev)
            t0 = time.perf_counter()
            with amp:
                loss = net(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        results.setdefault(mode.rstrip("2"), []).extend(times)
        del net, model, opt
    bare, ddp = statistics.median(results["bare"]), statistics.median(results["ddp"])
    if dist.get_rank() == 0:
        print(f"step time: bare {bare * 1e3:.1f} ms, DDP(world_size=1) {ddp * 1e3:.1f} ms")
        print(ratio_line("G3", "ddp_ws1/bare", "step_time", ddp / bare, backend=dist.get_backend()))
    dist.destroy_process_group()


def _amp(dev: torch.device, cfg):
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda" and cfg.train.precision == "bf16"
        else contextlib.nullcontext()
    )


def cmd_stats_sync(a: argparse.Namespace) -> None:
    """G4: issue 14 item 1. The old loop read its stats with .tolist() every step (a host-device sync
    that leaves the GPU idle while Python prepares the next step); StepMeter reads them one step late
    from pinned memory after an event. Same model and batch; wall time of N steps, one sync at the end."""
    dev = device()
    cfg = bench_config(a.smoke)
    cfg.train.compile = False  # the same eager step on both sides; compilation is G2's business
    steps, warmup = (6, 2) if a.smoke else (40, 10)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(dev)
    opt = build_optimizer(model, cfg.train, dev)
    x = torch.randint(cfg.model.gpt.vocab_size, (cfg.train.batch_size, cfg.model.gpt.block_size), device=dev)
    results: dict[str, list[float]] = {}
    for mode in ("sync", "meter", "sync2", "meter2"):  # ABAB against drift
        meter = StepMeter(dev.type == "cuda", ProgressBar(0, False), JsonlWriter(None))
        for i in range(warmup + steps):
            if i == warmup:
                sync(dev)
                t0 = time.perf_counter()
            with _amp(dev, cfg):
                loss = model(x, x)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            stats = torch.stack([loss.detach().float(), gnorm.float()])
            if mode.startswith("sync"):
                stats.tolist()
            else:
                meter.pop()
                meter.push(i, 0, 0.0, 0, stats, None)
        meter.pop()
        sync(dev)
        results.setdefault(mode.rstrip("2"), []).append((time.perf_counter() - t0) / steps)
    with_sync, without = statistics.median(results["sync"]), statistics.median(results["meter"])
    print(f"step time: .tolist() every step {with_sync * 1e3:.2f} ms, StepMeter {without * 1e3:.2f} ms")
    print(ratio_line("G4", "step_sync/step_meter", "step_time", with_sync / without, steps=steps))


def _token_file(path: Path, cfg, blocks: int) -> Path:
    g = torch.Generator().manual_seed(0)
    vocab = min(int(cfg.model.gpt.vocab_size), 50257)
    n = blocks * cfg.model.gpt.block_size + 1
    path.write_bytes(
        torch.randint(vocab, (n,), generator=g, dtype=torch.int32).to(torch.uint16).numpy().tobytes()
    )
    return path


def cmd_loader(a: argparse.Namespace) -> None:
    """G5: issue 14 item 2. Tokens/s the loader alone delivers from a token file (workers 0, and the
    config's persistent, pinned, prefetching workers) against the trainer's tokens/s on the same file:
    ratio loader(workers)/trainer > 1 means the GPU, not the loader, sets the pace."""
    cfg = bench_config(a.smoke)
    dev = device()
    bs, t = cfg.train.batch_size, cfg.model.gpt.block_size
    batches = 60 if a.smoke else 400
    with tempfile.TemporaryDirectory(prefix="gpu-bench-tokens-") as tmp:
        path = _token_file(Path(tmp) / "train.bin", cfg, bs * (batches + 10))
        rates = {}
        start = data.worker_start_method(dev)  # the trainer's: forkserver on CUDA (issue 31 item 6)
        for workers in (0, cfg.data.num_workers):
            ds = TokenFile(str(path), t, int(cfg.model.gpt.vocab_size))
            sb = ShardedBatches(
                ds, bs, 0, 1, cfg.seed, num_workers=workers, pin_memory=dev.type == "cuda", worker_start=start
            )
            sb.next()  # workers started
            t0 = time.perf_counter()
            for _ in range(batches):
                x, y = sb.next()
                x.to(dev, non_blocking=True)
            sync(dev)
            rates[workers] = batches * bs * t / (time.perf_counter() - t0)
            sb.close()
        sets = [*(SMOKE_SETS if a.smoke else GPU_SETS), "data.name=tokens", f"data.tokens.path={path}"]
        if not a.smoke:
            sets.append("train.compile=false")  # a short run: compilation would dominate it
        steps = 15 if a.smoke else 40
        train_tok, _ = trainer_run(sets, steps, a.smoke)
    w = cfg.data.num_workers
    print(
        f"loader alone: {rates[0]:.0f} tok/s with 0 workers, {rates[w]:.0f} with {w}; "
        f"trainer {train_tok:.0f} tok/s"
    )
    print(
        ratio_line(
            "G5",
            "loader/trainer",
            "tokens_s",
            rates[w] / train_tok,
            workers=w,
            start=start or "fork",
            loader_w0=f"{rates[0]:.0f}",
        )
    )


def cmd_logits_memory(a: argparse.Namespace) -> None:
    """G6: issue 14 item 5, issue 31 item 5. Peak memory of one forward+backward with an explicit
    logits.float() against the loss as autocast computes it (CUDA memory stats; on CPU nan). Under
    bf16 autocast makes the same fp32 copy itself (models._fp32_logits), so expect ~1.0; the absolute
    peak at this batch size sizes the per-rank micro-batch (docs/trainer.md)."""
    dev = device()
    cfg = bench_config(a.smoke)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(dev)
    x = torch.randint(cfg.model.gpt.vocab_size, (cfg.train.batch_size, cfg.model.gpt.block_size), device=dev)
    peaks = {}
    real = models._fp32_logits
    for mode, fn in (("float_copy", lambda logits: logits.float()), ("autocast", real)):
        models._fp32_logits = fn
        try:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            with _amp(dev, cfg):
                loss = model(x, x)
            loss.backward()
            model.zero_grad(set_to_none=True)
            sync(dev)
            peaks[mode] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
        finally:
            models._fp32_logits = real
    print(
        f"peak memory of a step: with logits.float() {peaks['float_copy']:.2f} GiB, "
        f"without {peaks['autocast']:.2f} GiB"
    )
    print(
        ratio_line(
            "G6",
            "mem_float_copy/mem_autocast",
            "peak_gib",
            peaks["float_copy"] / peaks["autocast"],
            peak_gib=f"{peaks['autocast']:.2f}",
            batch=cfg.train.batch_size,
        )
    )


def cmd_grad_memory(a: argparse.Namespace) -> None:
    """G7: issue 31 item 4. DDP(gradient_as_bucket_view=True) at world size 1 (the trainer itself skips
    DDP at one rank; here it is forced): peak memory and step time of steps 2..n with
    zero_grad(set_to_none=True), the old trainer (the bucket alias is destroyed every step: a new
    gradient and a copy into the bucket per backward), against set_to_none=False, the trainer now."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = device()
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cfg = bench_config(a.smoke)
    cfg.train.compile = False  # the gradients' memory, not compilation
    steps = 3 if a.smoke else 10
    peaks, times = {}, {}
    for mode in ("to_none", "in_place", "to_none2", "in_place2"):  # ABAB against drift
        torch.manual_seed(cfg.seed)
        model = build_model(cfg).to(dev)
        net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True)
        opt = build_optimizer(model, cfg.train, dev)
        x = torch.randint(
            cfg.model.gpt.vocab_size, (cfg.train.batch_size, cfg.model.gpt.block_size), device=dev
        )
        t0 = 0.0
        for i in range(steps + 2):  # steps 1-2 warm up: DDP rebuilds its buckets after the first
            if i == 2:
                sync(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
            with _amp(dev, cfg):
                loss = net(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=mode.startswith("to_none"))
        sync(dev)
        key = mode.rstrip("2")
        times.setdefault(key, []).append((time.perf_counter() - t0) / steps)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
        peaks[key] = max(peaks.get(key, 0.0), peak) if peak == peak else peak
        del net, model, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"DDP bucket views, peak memory: set_to_none=True {peaks['to_none']:.2f} GiB "
            f"({ms['to_none']:.1f} ms/step), in place {peaks['in_place']:.2f} GiB "
            f"({ms['in_place']:.1f} ms/step)"
        )
        print(
            ratio_line(
                "G7",
                "mem_set_to_none/mem_in_place",
                "peak_gib",
                peaks["to_none"] / peaks["in_place"],
                step_time_ratio=f"{ms['to_none'] / ms['in_place']:.3f}",
            )
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checks = {
        "matmul": cmd_matmul,
        "trainer-vs-minimal": cmd_trainer_vs_minimal,
        "ddp-vs-bare": cmd_ddp_vs_bare,
        "stats-sync": cmd_stats_sync,
        "loader": cmd_loader,
        "logits-memory": cmd_logits_memory,
        "grad-memory": cmd_grad_memory,
        "eval-timing": cmd_eval_timing,
        "checkpoint-cost": cmd_checkpoint_cost,
    }
    p.add_argument("check", choices=list(checks))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, not the GPU")
    a = p.parse_args()
    checks[a.check](a)


if __name__ == "__main__":
    main()
