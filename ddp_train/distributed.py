"""The one place that reads torchrun's environment, starts/stops the process group and picks the device.

Without RANK in the environment the trainer runs as a single process with no process group at all;
every collective helper below is then a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_train import storage
from ddp_train.config import ConfigError, DistConfig

log = logging.getLogger("ddp_train")


@dataclass(frozen=True)
class DistEnv:
    """What torchrun told this process (world_size 1 and distributed False when run alone)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    distributed: bool = False
    agent_store: bool = False  # TORCHELASTIC_USE_AGENT_STORE: torchrun's store, shared across restarts

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Parse RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        return DistEnv()

    def integer(name: str, default: int | None = None) -> int:
        raw = env.get(name)
        if raw is None and default is not None:
            return default
        try:
            return int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError("environment", name, f"{raw!r} is not an integer (set by torchrun)") from None

    rank, world = integer("RANK"), integer("WORLD_SIZE")
    if not 0 <= rank < world:
        raise ConfigError("environment", "RANK", f"{rank} is outside 0..WORLD_SIZE-1 ({world - 1})")
    port = env.get("MASTER_PORT")
    return DistEnv(
        rank=rank,
        local_rank=integer("LOCAL_RANK", 0),
        world_size=world,
        local_world_size=integer("LOCAL_WORLD_SIZE", 1),
        master_addr=env.get("MASTER_ADDR"),
        master_port=int(port) if port and port.isdigit() else None,
        distributed=True,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def select_device(cfg: DistConfig, env: DistEnv) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is wanted and present, else cpu."""
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("config", "dist.device", "'cuda' requested but CUDA is not available")
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise ConfigError("config", "dist.device", f"LOCAL_RANK {env.local_rank} but only {count} GPU(s)")
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device


def select_backend(cfg: DistConfig, device: torch.device) -> str:
    """nccl for CUDA and gloo for CPU unless dist.backend says otherwise."""
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("config", "dist.backend", "'nccl' needs a CUDA device (use gloo on CPU)")
    return cfg.backend


def wrap(model: nn.Module, env: DistEnv, device: torch.device, bucket_cap_mb: float = 25.0) -> nn.Module:
    """`model` in DDP when there are ranks to average with, else `model` itself: one rank has nothing
    to average, and DDP would only copy gradients into buckets, all-reduce them with itself and split
    a compiled graph at every bucket (DDPOptimizer). `bucket_cap_mb`: dist.bucket_cap_mb, the size of
    DDP's gradient buckets (torch's default 25; bench C2 sweeps it)."""
    if not (env.distributed and env.world_size > 1):
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)


def settle_buckets(model: nn.Module, loss: Callable[[], torch.Tensor], device: torch.device) -> None:
    """Before a resumed run's first step: one forward and backward of a zero loss, so that its first real
    step reduces exactly as that step did in the run it resumes. DDP's first backward in a process
    all-reduces every gradient as one bucket (initial bucketing is off, distributed.py
    _BucketCapacityConfig.compute_bucket_size_limits), scales it g * (1/N) while copying it into the bucket,
    then rebuilds the buckets in gradient-ready order; later steps reduce in those buckets and scale g / N
    in place (reducer.cpp mark_variable_ready_dense). With 3 or more ranks another bucket layout sums the
    ranks in another order and 1/N is inexact, so without this a resume drifted in the last bits from
    its first step on (3 ranks: equal parameters at the saved step, different one step later). The
    gradients it leaves are zeros in the buckets' views; RNG streams and buffers are put back."""
    if not isinstance(model, DDP):
        return
    buffers = [b.detach().clone() for b in model.module.buffers()]
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        (loss() * 0).backward()
    with torch.no_grad():
        for buf, saved in zip(model.module.buffers(), buffers, strict=True):
            buf.copy_(saved)
        for p in model.module.parameters():
            if p.grad is not None:
                p.grad.zero_()  # in place: the gradients stay views of the buckets, as after a step


def no_sync(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What the micro-steps before the last one of an optimizer step run under: DDP's no_sync (their
    backward accumulates locally, only the last one averages over ranks), else nothing."""
    return model.no_sync if isinstance(model, DDP) else contextlib.nullcontext


def grads_to_none(model: nn.Module) -> bool:
    """zero_grad's set_to_none for `model`: under DDP the gradients are views into its all-reduce
    buckets from the first step on, as long as they are zeroed in place; set_to_none=True destroys the
    alias every step, so each backward allocates new gradients and copies them into the buckets (torch
    2.13 nn/parallel/distributed.py, the `batched_grad_copy` doc: "the bucket view alias is destroyed
    every iteration"; test_ddp_gradients_stay_views_of_the_buckets checks it). Without DDP, None frees
    the memory between steps instead."""
    return not isinstance(model, DDP)


# PyTorch's NCCL flight recorder: on a collective timeout the watchdog dumps the last collectives of every
# rank. TORCH_NCCL_DUMP_ON_TIMEOUT needs a trace buffer > 0 and TORCH_NCCL_ENABLE_MONITORING (on by
# default); the files are <dump file prefix><rank> (torch 2.13: c10d/ProcessGroupNCCL.hpp and
# FlightRecorder.hpp, where TORCH_FR_BUFFER_SIZE / TORCH_FR_DUMP_TEMP_FILE are the current names and
# TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE the deprecated ones that still work).
# Read when the group is created, so set before init.
FLIGHT_RECORDER_BUFFER = "2000"


def flight_recorder_env(run_dir: Any, environ: Any = None) -> dict[str, str]:
    """The flight recorder defaults this run adds (a variable the user set, under either name, wins)."""
    env = os.environ if environ is None else environ
    added = {}
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        added["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_FR_BUFFER_SIZE" not in env:
        added["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_BUFFER
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env and "TORCH_FR_DUMP_TEMP_FILE" not in env:
        added["TORCH_FR_DUMP_TEMP_FILE"] = f"{run_dir}/nccl_trace_rank_"
    return added


def make_dump_dirs(environ: Any = None, ours: Any = ()) -> None:
    """Create the directory of the flight recorder's dump files on this rank. torch's writer creates no
    directory: DebugInfoWriter::write opens a std::ofstream and only logs "Error opening file for
    writing Flight Recorder debug info" (torch 2.13 c10d/FlightRecorderDetail.hpp), and only rank 0
    creates the run directory, so without this every other rank's trace would be lost.
    Both names, whichever the user set; a directory that cannot be made is a warning only. torch's writer
    follows symlinks, so the directory must be this user's alone (storage.own_dir; else RefusedPath, one
    line naming the variable, or run.dir for those in `ours`, the ones flight_recorder_env set; #44)."""
    env = os.environ if environ is None else environ
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if env.get(name):
            directory = Path(env[name]).parent
            try:
                where = "run.dir to a directory" if name in ours else f"{name} to a path in a directory"
                storage.own_dir(directory, fix=f"set {where} of yours")
            except OSError as exc:
                log.warning("%s: cannot create %s for NCCL trace dumps: %s", name, directory, exc)


def compile_threads_env(env: DistEnv, environ: Any = None) -> dict[str, str]:
    """TORCHINDUCTOR_COMPILE_THREADS = this node's cores / its ranks, unless set. Inductor otherwise
    gives every rank min(32, cores) compile workers (torch 2.13 _inductor/config.py
    decide_compile_threads, read once when torch._inductor.config is first imported: set it before)."""
    environ = os.environ if environ is None else environ
    if "TORCHINDUCTOR_COMPILE_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, cores // max(1, env.local_world_size)))}


def first_step_timeout_s(cfg: DistConfig, compiled: bool) -> float:
    """The collective timeout until the compiled steps ran once (CompileTimeouts)."""
    return max(cfg.compile_timeout_s, cfg.collective_timeout_s) if compiled else cfg.collective_timeout_s


class CompileTimeouts:
    """Compiled, the first training step and the first validation compile on every rank, at different
    speeds, and the first collective after them waits for the slowest: dist.compile_timeout_s applies
    until the first step ran (trainer.run starts the group with it) and during the first validation,
    collective_timeout_s otherwise."""

    def __init__(self, cfg: DistConfig, compiled: bool, distributed: bool) -> None:
        self.cfg, self.first_s = cfg, first_step_timeout_s(cfg, compiled)
        self.pending = {"train", "eval"} if compiled and distributed else set()

    def before(self, phase: str) -> None:
        """`phase` is about to run: its first, compiling run gets the compile timeout."""
        if phase in self.pending:
            set_collective_timeout(self.first_s)

    def ran(self, phase: str) -> None:
        """`phase` ("train" or "eval") has run compiled on every rank: back to the collective timeout
        unless the first training step is still on its way."""
        if phase not in self.pending:
            return
        self.pending.discard(phase)
        if "train" not in self.pending:
            set_collective_timeout(self.cfg.collective_timeout_s)


_IO_STORE: Any = None  # the rendezvous store, for waits that must not be collectives (wait_for_io)
_IO_SEQ = 0


def init(
    cfg: DistConfig, env: DistEnv, device: torch.device, collective_timeout_s: float | None = None
) -> str | None:
    """Join the process group (env:// rendezvous from torchrun); returns the backend or None alone.

    Two timeouts: dist.init_timeout_s bounds the rendezvous and the group's setup (all ranks joining),
    dist.collective_timeout_s (or `collective_timeout_s`, e.g. longer until compiled: see
    set_collective_timeout) every collective afterwards. The rendezvous store is kept for wait_for_io.
    """
    global _IO_STORE, _IO_SEQ
    if not env.distributed:
        return None
    backend = select_backend(cfg, device)
    init_timeout = datetime.timedelta(seconds=cfg.init_timeout_s)
    timeout = cfg.collective_timeout_s if collective_timeout_s is None else collective_timeout_s
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = device  # eager NCCL init bound to this rank's GPU (torch >= 2.3)
    # What init_process_group(init_method="env://") does itself (distributed_c10d.init_process_group:
    # rendezvous(...) then PrefixStore), done here so the rendezvous gets the init timeout and the group
    # the collective timeout; with torchrun's agent store this connects to that store as a client.
    store, rank, world = next(dist.rendezvous("env://", timeout=init_timeout))
    store.set_timeout(init_timeout)
    if env.agent_store:
        namespace = _fresh_namespace(store, rank, world, cfg.init_timeout_s)
    else:
        namespace = "ddp_train/pg/"
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(namespace, store), rank=rank, world_size=world, **kwargs
    )
    _IO_STORE, _IO_SEQ = dist.PrefixStore(namespace + "io/", store), 0
    return backend


def set_collective_timeout(seconds: float) -> None:
    """The timeout of the collectives issued from now on (no-op alone), as torchtitan lowers its
    init timeout after the first step (torchtitan distributed/utils.py set_pg_timeouts). torch 2.13
    distributed_c10d._set_pg_timeout sets the default timeout of the group's gloo and NCCL backends."""
    if active():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


class PeerFailure(RuntimeError):
    """This rank stops because another rank failed or went away (its own line names that rank)."""


def wait_for_io(
    src: int, timeout_s: float, what: str = "its checkpoint I/O", failed: str | None = None
) -> None:
    """Wait until rank `src` finished its I/O (`what`: a checkpoint save/load) before the next collective.

    Every rank calls it at the same point: `src` publishes a key, the others wait on the store for up
    to `timeout_s`. A store wait, not a barrier, so a long fsync on one rank cannot trip the process
    group's collective timeout on the others. `failed` (on `src`): its one-line error, which the
    others raise as a PeerFailure instead of waiting for a connection that closes. No-op alone.
    """
    global _IO_SEQ
    if not active() or _IO_STORE is None:
        return
    _IO_SEQ += 1
    key = f"done/{_IO_SEQ}"
    if dist.get_rank() == src:
        _IO_STORE.set(key, "1" if failed is None else f"failed:{failed}")
        return
    t0 = time.monotonic()
    try:
        _IO_STORE.wait([key], datetime.timedelta(seconds=timeout_s))
        value = _IO_STORE.get(key).decode("utf-8", "replace")
    except Exception as exc:  # the store raises DistStoreError on timeout, DistNetworkError when it closes
        waited = time.monotonic() - t0
        if waited < timeout_s:
            raise PeerFailure(
                f"rank {src} failed: the store connection closed after {waited:.1f}s while this rank waited "
                f"for {what} ({type(exc).__name__})"
            ) from None
        raise TimeoutError(
            f"rank {src} did not finish {what} within checkpoint.io_timeout_s={timeout_s:g}s"
        ) from None
    if value.startswith("failed:"):
        raise PeerFailure(f"rank {src} failed: {value[len('failed:') :]}")


def _fresh_namespace(store: dist.Store, rank: int, world: int, timeout_s: float) -> str:
    """A store prefix that every rank of this group, and no earlier group, agrees on.

    torchrun's agent keeps one TCPStore across --max-restarts rounds and the workers' keys get no
    per-round prefix (pytorch/pytorch#135712, #167288), so a restarted group can read the dead group's
    gloo/NCCL addresses and fail with "connection refused". TORCHELASTIC_RESTART_COUNT is not the same
    on every node, so rank 0 instead publishes a random nonce; the others acknowledge it. A stale nonce
    is recognised by its overfull acknowledgement count, or simply replaced when rank 0 publishes.
    """
    base = "ddp_train/pg"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        nonce = secrets.token_hex(8)
        store.set(f"{base}/nonce", nonce)
        while int(store.add(f"{base}/{nonce}/acks", 0)) < world - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not acknowledge the process-group namespace in {timeout_s:g}s")
            time.sleep(0.02)
        store.set(f"{base}/{nonce}/go", "1")
        return f"{base}/{nonce}/"
    seen, stale = None, True
    while time.monotonic() < deadline:
        nonce = store.get(f"{base}/nonce").decode()
        if nonce != seen:
            seen = nonce
            stale = int(store.add(f"{base}/{nonce}/acks", 1)) > world - 1
        if not stale and store.check([f"{base}/{nonce}/go"]):
            return f"{base}/{nonce}/"
        time.sleep(0.02)
    raise TimeoutError(f"rank 0 did not publish a process-group namespace in {timeout_s:g}s")


def shutdown() -> None:
    """Leave the process group if one was joined (call from a `finally`)."""
    global _IO_STORE
    _IO_STORE = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    """True when this process has joined a process group."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank (no-op alone)."""
    if active():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (no-op alone); returns the tensor."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def _comm_device(device: torch.device | None = None) -> torch.device:
    if dist.get_backend() == "nccl":
        return device if device is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_async(tensor: torch.Tensor) -> Any:
    """Start an in-place sum over ranks; returns the work to wait() on (None alone)."""
    if not active():
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (a one-element list alone)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)  # NCCL: through the current CUDA device, set by select_device
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable object on every rank (large tensors go through broadcast_state)."""
    if not active():
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class _TensorSlot:
    """Placeholder for a tensor inside a broadcast skeleton: where it sits, its shape and dtype."""

    def __init__(self, index: int, path: tuple[Any, ...], tensor: torch.Tensor) -> None:
        self.index, self.path, self.shape, self.dtype = index, path, tuple(tensor.shape), tensor.dtype


def _split(obj: Any, tensors: list[torch.Tensor], path: tuple[Any, ...] = ()) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, path, obj)
    if isinstance(obj, dict):
        return {k: _split(v, tensors, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, tensors, (*path, i)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_join(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _target(into: Mapping[str, Mapping[Any, torch.Tensor]], slot: _TensorSlot, comm: torch.device) -> Any:
    """The caller's tensor at the slot's place, if the received bytes can land in it directly."""
    if len(slot.path) != 2 or not isinstance(into.get(slot.path[0]), Mapping):
        return None
    t = into[slot.path[0]].get(slot.path[1])
    fits = isinstance(t, torch.Tensor) and tuple(t.shape) == slot.shape and t.dtype == slot.dtype
    return t if fits and t.device == comm and t.is_contiguous() else None


def broadcast_state(
    state: Any,
    device: torch.device,
    src: int = 0,
    into: Mapping[str, Mapping[Any, torch.Tensor]] | None = None,
    on_device: tuple[str, ...] = (),
) -> Any:
    """Send a nested state (dicts/lists of tensors and plain values) from `src` to every rank.

    The structure travels pickled, the tensors one by one with dist.broadcast, so a large model state
    never goes through pickle. No rank but `src` holds a CPU copy of the large tensors: a tensor whose
    place {key: {name: tensor}} exists in `into` (a model's state_dict) is received straight into that
    tensor; other tensors under the top-level keys in `on_device` (optimizer state) stay where they
    were received (the GPU under NCCL), except 0-dim ones such as Adam's step counter; the rest is
    small (RNG states) and moved to CPU. Lets the checkpoint live on one node only.
    """
    if not active():
        return state
    is_src = dist.get_rank() == src
    tensors: list[torch.Tensor] = []
    skeleton = _split(state, tensors) if is_src else None
    skeleton = broadcast_object(skeleton, src)
    if skeleton is None:
        return None
    slots: list[_TensorSlot] = []
    _collect_slots(skeleton, slots)
    comm = _comm_device(device)
    received: list[torch.Tensor] = [torch.empty(0)] * len(slots)
    for slot in sorted(slots, key=lambda s: s.index):
        if is_src:
            buf = tensors[slot.index].detach().to(comm).contiguous()
            dist.broadcast(buf, src=src)
            received[slot.index] = tensors[slot.index]
            continue
        target = _target(into or {}, slot, comm)
        buf = target if target is not None else torch.empty(slot.shape, dtype=slot.dtype, device=comm)
        dist.broadcast(buf, src=src)
        keep = target is not None or (bool(slot.path) and slot.path[0] in on_device and buf.dim() > 0)
        received[slot.index] = buf if keep else buf.cpu()
    return _join(skeleton, received)


def _collect_slots(obj: Any, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)
