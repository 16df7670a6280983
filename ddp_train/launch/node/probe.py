"""Preflight's probe, with the node's venv python and the job's environment: versions, GPUs, hostname
resolution, RDMA ports, interfaces and GPU health in one SSH round trip.

    probe VENV WORKDIR [--netif CIDR TARGETS-JSON] [--gpu-health-off] [--gpu-health-dcgm]

prints `DDP-PROBE {facts}`, then `DDP-NETIF {...}` (with --netif) and `DDP-GPU {...}` (unless
--gpu-health-off), each judged on the controller (preflight, netif, gpuhealth)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

PROBE_MARK, NETIF_MARK, GPU_MARK = "DDP-PROBE ", "DDP-NETIF ", "DDP-GPU "
# Asked in one --query-gpu call; a field this nvidia-smi does not know ('Field "x" is not a valid
# field to query.', exit 2) is dropped and the call repeated, so an older driver still answers.
GPU_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "driver_version",
    "persistence_mode",
    "mig.mode.current",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "utilization.gpu",  # these three: doctor's GPU use columns (another user's job on the GPUs)
    "memory.used",
    "memory.total",
)
# Rows remapping replaced page retirement on A100/H100 (retired_pages.* read [N/A] there); the
# remap fields are a query of their own, not --query-gpu fields.
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.pending", "remapped_rows.failure", "remapped_rows.uncorrectable")
TORCH_CACHE_S = 3600
GPU_BUDGET_S = 90  # the probe's SSH call allows 120 s in all, counted from the probe's start

Facts = dict[str, Any]


def collect_basics(venv: str, workdir: str) -> Facts:
    """Python, hostname resolution, setsid, torchrun, workdir and the provisioning fingerprint."""
    r: Facts = {"python": ".".join(str(v) for v in sys.version_info[:3]), "executable": sys.executable}
    r["hostname"] = host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        r["hostname_ips"] = sorted({str(a[4][0]) for a in infos})
    except OSError as e:
        r["hostname_error"] = str(e)
    r["setsid"] = shutil.which("setsid")
    r["torchrun"] = os.access(os.path.join(venv, "bin", "torchrun"), os.X_OK)
    r["workdir_ok"] = not workdir or os.path.isdir(workdir)
    try:
        with open(os.path.join(venv, "ddp-train-fingerprint.json")) as f:
            r["fingerprint"] = json.load(f)
    except (OSError, ValueError):
        pass
    try:  # the kernel's neighbour table limit, compared with the cluster size (issue #19)
        with open("/proc/sys/net/ipv4/neigh/default/gc_thresh3") as f:
            r["gc_thresh3"] = int(f.read())
    except (OSError, ValueError):
        pass
    return r


def _torch_cache_file() -> str:
    """Importing torch costs seconds per node, so its facts are cached on the node for an hour (as
    horovodrun caches its SSH checks), keyed by everything that can change them: the python, torch's
    installed files, the driver, and the env vars that select GPUs and libraries."""
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec else None
    key: list[Any] = [sys.executable, origin]
    for f in ([os.path.join(os.path.dirname(origin), "version.py")] if origin else []) + [
        "/proc/driver/nvidia/version"
    ]:
        try:
            st = os.stat(f)
            key.append((f, st.st_mtime_ns, st.st_size))
        except OSError:
            key.append((f, None))
    names = ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "NCCL_HOME")
    key += [os.environ.get(k) for k in names]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return os.path.join(os.path.expanduser("~"), ".cache", "ddp-launch", f"torch-{digest}.json")


def collect_torch() -> Facts:
    """torch, CUDA, NCCL and the GPU count (cached, see `_torch_cache_file`), and the trainer's version."""
    r: Facts = {}
    cache_file = None
    try:
        cache_file = _torch_cache_file()
        fresh = time.time() - os.stat(cache_file).st_mtime < TORCH_CACHE_S
        if fresh and os.environ.get("DDP_LAUNCH_PROBE_CACHE", "1") != "0":
            with open(cache_file) as f:
                r.update(json.load(f))
                r["torch_cached"] = True
    except (OSError, ValueError):
        pass
    if "torch" not in r:
        try:
            import torch

            t: Facts = {"torch": torch.__version__, "cuda": torch.version.cuda}
            gpu = torch.cuda.is_available()
            t["gpus"] = torch.cuda.device_count() if gpu else 0
            if gpu:
                v = torch.cuda.nccl.version()
                t["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            r.update(t)
            if cache_file:
                _write_cache(cache_file, t)
        except Exception as e:  # noqa: BLE001 - any import failure is a fact to report
            r["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        if importlib.util.find_spec("ddp_train.__main__") is None:
            r["ddp_train_error"] = "ddp_train has no __main__ (python -m ddp_train would fail)"
        else:
            import ddp_train

            try:
                from importlib.metadata import version

                r["ddp_train"] = version("ddp-train")
            except Exception:  # noqa: BLE001
                r["ddp_train"] = getattr(ddp_train, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001
        r["ddp_train_error"] = f"{type(e).__name__}: {e}"
    return r


def _write_cache(cache_file: str, facts: Facts) -> None:
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(facts, f)
        os.replace(tmp, cache_file)
    except OSError:
        pass


def rdma_ports(root: str) -> list[dict[str, str | None]]:
    """Raw sysfs values, one dict per port, of /sys/class/infiniband/<hca>/ports/<n>/{state,link_layer,
    rate} under `root` (kernel ABI: Documentation/ABI/stable/sysfs-class-infiniband), and as "netdev" the
    net device of GID 0 (gid_attrs/ndevs/0: a RoCE port's Ethernet interface; IB ports have none)."""
    base = os.path.join(root, "sys", "class", "infiniband")
    out: list[dict[str, str | None]] = []
    try:
        hcas = sorted(os.listdir(base))
    except OSError:
        return out
    for hca in hcas:
        pdir = os.path.join(base, hca, "ports")
        try:
            ports = sorted(os.listdir(pdir), key=lambda p: (not p.isdigit(), int(p) if p.isdigit() else 0, p))
        except OSError:
            continue
        for port in ports:
            e: dict[str, str | None] = {"hca": hca, "port": port}
            for key, rel in (("state", "state"), ("link_layer", "link_layer"), ("rate", "rate"),
                             ("netdev", os.path.join("gid_attrs", "ndevs", "0"))):  # fmt: skip
                try:
                    with open(os.path.join(pdir, port, rel)) as f:
                        e[key] = f.read().strip()
                except OSError:
                    e[key] = None
            out.append(e)
    return out


def collect_rdma() -> list[dict[str, str | None]]:
    """The node's RDMA ports under DDP_RDMA_ROOT (tests) or /."""
    return rdma_ports(os.environ.get("DDP_RDMA_ROOT") or "/")


def collect_netif(cidr: str, targets: Sequence[str]) -> Facts:
    """`ip -j addr show`, and `ip -j route get` to the first target that is not the node's own address
    (`cidr` is in the argv for a reader of `ps` only)."""
    ipbin = shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip") if os.access(p, os.X_OK)), None
    )
    if not ipbin:
        return {"error": "ip (iproute2) not found on the node"}

    def ip_json(*args: str) -> Any:
        p = subprocess.run([ipbin, "-j", *args], capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            raise RuntimeError(
                "ip -j {}: {}".format(" ".join(args), (p.stderr or "").strip() or p.returncode)
            )
        return json.loads(p.stdout or "[]")

    r: Facts = {}
    try:
        r["addr"] = ip_json("addr", "show")
        own = {a.get("local") for i in r["addr"] for a in i.get("addr_info", [])}
        target = next((t for t in targets if t not in own), None)
        if target:
            r["route_to"] = target
            r["route"] = ip_json("route", "get", target)
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
        r["error"] = str(e)
    return r


def _run(cmd: list[str], end: float, limit: float = 20) -> list[Any]:
    """[exit code, output] of `cmd`, killed after `limit` s or at `end`, whichever comes first."""
    left = max(1, int(min(limit, end - time.time())))
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, universal_newlines=True, errors="replace")  # fmt: skip
    except OSError as e:
        return [126, f"{cmd[0]}: {e.strerror or e}"]
    try:
        out = p.communicate(timeout=left)[0]
        return [p.returncode, out[-30000:]]
    except subprocess.TimeoutExpired:
        p.kill()  # an nvidia-smi stuck in D state (GPU off the bus) may never die: don't wait on it
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.communicate(timeout=2)
        return [124, f"{os.path.basename(cmd[0])} timed out after {left}s"]


def _fabric_lines(out: str) -> str:
    """The GPU header lines and their Fabric sections of `nvidia-smi -q`."""
    keep: list[str] = []
    depth = None
    for line in out.splitlines():
        indent = len(line) - len(line.lstrip())
        if re.match(r"GPU [0-9A-Fa-f]+:[0-9A-Fa-f]{2}:", line):
            keep.append(line)
            depth = None
        elif line.strip() == "Fabric":
            keep.append(line)
            depth = indent
        elif depth is not None and line.strip() and indent > depth:
            keep.append(line)
        elif line.strip():
            depth = None
    return "\n".join(keep)


def collect_gpu(dcgm: bool, t0: float) -> Facts:
    """The raw outputs gpuhealth judges: `nvidia-smi --query-gpu`, `--query-remapped-rows`, the Fabric
    lines of `nvidia-smi -q`, the fabric manager's state, the kernel log's Xid lines and, when `dcgm`,
    `dcgmi diag -r 1`; all within GPU_BUDGET_S of `t0` (the torch import may already have used some)."""
    end = t0 + GPU_BUDGET_S
    smi = shutil.which("nvidia-smi")
    h: Facts = {"driver": os.path.exists("/proc/driver/nvidia/version"), "smi": smi}
    if not smi and not h["driver"]:
        return h  # no NVIDIA GPU here: nothing to check
    if smi:
        fields = list(GPU_FIELDS)
        while True:
            code, out = _run([smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"], end)
            bad = re.search(r'Field "([^"]+)" is not a valid field', out)
            if not (code and bad and bad.group(1) in fields[3:]):
                break
            fields.remove(bad.group(1))
        h["query"] = [code, out, fields]
        if code == 0:
            remap = "--query-remapped-rows=" + ",".join(REMAP_FIELDS)
            h["remap"] = _run([smi, remap, "--format=csv,noheader,nounits"], end)
            code, out = _run([smi, "-q"], end)
            h["fabric"] = [code, _fabric_lines(out) if code == 0 else out]
    try:
        h["nvswitches"] = len(os.listdir("/proc/driver/nvidia-nvswitch/devices"))
    except OSError:
        h["nvswitches"] = 0
    if h["nvswitches"] and shutil.which("systemctl"):
        h["fm_service"] = _run(["systemctl", "is-active", "nvidia-fabricmanager"], end, 10)
    h["kernel_log"] = _kernel_log(end)
    if dcgm:
        exe = shutil.which("dcgmi")
        h["dcgm"] = _run([exe, "diag", "-r", "1"], end, 75) if exe else None
    return h


def _kernel_log(end: float) -> dict[str, Any]:
    tried = []
    for cmd in (["dmesg"], ["journalctl", "-k", "-b", "-q", "--no-pager"]):
        exe = shutil.which(cmd[0])
        if not exe:
            continue
        code, out = _run([exe, *cmd[1:]], end)
        if code == 0 and "insufficient permissions" not in out and "not seeing messages" not in out:
            marks = ("NVRM: Xid", "NVRM: The NVIDIA GPU", "fallen off the bus")
            lines = [ln for ln in out.splitlines() if any(m in ln for m in marks)]
            return {"source": " ".join(cmd), "lines": lines[-200:]}
        tried.append(f"{' '.join(cmd)}: {(out.strip().splitlines() or [f'exit {code}'])[-1][:200]}")
    return {"error": "; ".join(tried) or "neither dmesg nor journalctl found"}


def main(argv: list[str], t0: float | None = None) -> int:
    """VENV WORKDIR [flags]: the facts line, then the interface line and the GPU health line."""
    t0 = time.time() if t0 is None else t0
    venv, workdir, flags = argv[0], argv[1], argv[2:]
    r = collect_basics(venv, workdir)
    r.update(collect_torch())
    r["rdma"] = collect_rdma()
    print(PROBE_MARK + json.dumps(r), flush=True)
    if "--netif" in flags[:-2]:  # the CIDR and a JSON list of addresses in it to ask the route for
        at = flags.index("--netif")
        print(NETIF_MARK + json.dumps(collect_netif(flags[at + 1], json.loads(flags[at + 2]))), flush=True)
    if "--gpu-health-off" not in flags:
        try:
            gpu = collect_gpu("--gpu-health-dcgm" in flags, t0)
        except Exception as e:  # noqa: BLE001 - reported, judged on the controller
            gpu = {"error": f"{type(e).__name__}: {e}"}
        print(GPU_MARK + json.dumps(gpu), flush=True)
    return 0
