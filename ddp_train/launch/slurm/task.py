"""The program srun starts on every node of the allocation (`python -m ddp_train.launch.slurm.task`, one
task per node): `--node` runs the node's part of the training step, `--probe` its part of the in-job
preflight, `--stage` (no shared storage) creates ddp_workdir and unpacks the job's --sync copy. The job
comes as one JSON line on stdin (srun broadcasts the driver's line to every task).

--node: node rank = SLURM_NODEID, its own interface in the CIDR (GLOO/NCCL_SOCKET_IFNAME, --local-addr, as
preflight/netif.py sets them for the SSH backend), plan.py's torchrun argv with the driver's address and
port, then `python -m ddp_train.agent` with the environment on its stdin. A later line on stdin is the
driver's stop (protocol.STOP): SIGTERM to its torchrun alone, unless Slurm's own step signal reached it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STOP_DELAY_S = 1.0  # a stop line waits this long for Slurm's own SIGTERM of the same scancel


def torchrun_argv(
    template: Sequence[str],
    *,
    rank: int,
    nnodes: int,
    addr: str,
    port: int,
    local_addr: str | None,
    static: bool,
) -> list[str]:
    """plan.py's torchrun argv for this node: the driver's address and port, rank = SLURM_NODEID."""
    out = list(template)
    endpoint = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    values = {
        "--nnodes": str(nnodes),
        "--master-addr": addr,
        "--master-port": str(port),
        "--rdzv-endpoint": endpoint,
    }
    if static:
        values["--node-rank"] = str(rank)
    if local_addr and not static:
        values["--local-addr"] = local_addr
    i = 1
    while i + 1 < len(out) and out[i].startswith("--"):  # torchrun's own "--flag value" pairs
        if out[i] in values:
            out[i + 1] = values.pop(out[i])
        i += 2
    if "--local-addr" in values:
        from ddp_train.launch.preflight.netif import with_local_addr

        out = list(with_local_addr(out, values["--local-addr"]))
    return out


def own_address(cidr: str | None) -> tuple[str, str | None]:
    """(this node's address in the CIDR, its interface); without a CIDR the hostname's address."""
    if not cidr:
        return socket.gethostbyname(socket.gethostname()), None
    from ddp_train.launch.node.probe import collect_netif
    from ddp_train.launch.preflight.netif import choose, network

    net = network(cidr)
    targets = [str(t) for t in ([net[-2], net[1], net[2]] if net.num_addresses >= 4 else list(net))]
    choice = choose(cidr, collect_netif(cidr, targets))
    return choice.address, choice.dev


def node_main() -> None:
    job: dict[str, Any] = json.loads(_read_line())
    rank = int(os.environ["SLURM_NODEID"])
    env: dict[str, str] = dict(job["env"])
    local_addr = None
    if job.get("cidr"):
        try:
            local_addr, dev = own_address(job["cidr"])
        except ValueError as e:
            print(f"ddp-slurm: {socket.gethostname()}: {e}", flush=True)
            os._exit(3)
        from ddp_train.launch.preflight.netif import Choice, settings

        env.update(settings(Choice(dev=dev or "", address=local_addr, prefixlen=0), env)[0])
    argv = torchrun_argv(
        job["argv"],
        rank=rank,
        nnodes=int(job["nnodes"]),
        addr=job["master_addr"],
        port=int(job["master_port"]),
        local_addr=local_addr,
        static=bool(job["static"]),
    )
    workdir = job.get("workdir") or None
    if job.get("config"):
        _write_config(job["config"]["path"], job["config"]["text"], workdir)
    signalled = threading.Event()  # Slurm's own step signal (a plain scancel) reaches torchrun directly
    signal.signal(signal.SIGTERM, lambda *_: signalled.set())
    python = f"{job['venv'].rstrip('/')}/bin/python"
    proc = subprocess.Popen(
        [python, "-m", "ddp_train.agent", *argv],
        stdin=subprocess.PIPE,
        cwd=workdir,
        env=_agent_env(job["job_id"]),
    )
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(env) + "\n").encode())
    proc.stdin.close()

    def watch() -> None:
        while _read_line():  # the only other line the driver sends is STOP
            # after a plain scancel torchrun got Slurm's SIGTERM already (and the driver's stop line
            # follows it): a second one would cut its shutdown short
            if not signalled.wait(STOP_DELAY_S) and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    code = proc.wait()
    if code < 0:  # srun --kill-on-bad-exit ended the step while this node's ranks were still exiting
        code = 128 - code
    sys.stdout.flush()
    os._exit(code)  # not through the interpreter's shutdown while `watch` blocks in a read of stdin


def _read_line() -> bytes:
    """One line of stdin, read byte by byte from the descriptor (no buffer that reads ahead)."""
    line = b""
    while not line.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        line += c
    return line


def _agent_env(job_id: str) -> Mapping[str, str]:
    env = dict(os.environ, DDP_JOB_ID=job_id, DDP_SLURM_STEP="1")
    env.pop("SLURM_CPU_BIND", None)
    return env


def _write_config(path: str, text: str, workdir: str | None) -> None:
    full = Path(workdir or ".", path) if not path.startswith("/") else Path(path)
    full.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def probe_main() -> int:
    """The in-job preflight's task on every node: the SSH preflight's probe, with the job's environment
    (less its id and secrets: launch/preflight/preflight.py probe_env) and its GPU health options."""
    from ddp_train.launch.node import probe
    from ddp_train.launch.plan.plan import is_secret
    from ddp_train.launch.preflight import gpuhealth

    job: dict[str, Any] = json.loads(_read_line())
    env = {k: v for k, v in job["env"].items() if k != "DDP_JOB_ID" and not is_secret(k, v)}
    os.environ.update(env)
    gpu = gpuhealth.probe_args(job.get("gpu_health", "strict"), bool(job.get("gpu_health_dcgm")))
    return probe.main([job["venv"], job.get("workdir") or "", *gpu])


def stage_main() -> int:
    """No shared storage: ddp_workdir on this node (made, or checked to be this user's alone:
    storage.own_dir), and the job's --sync copy unpacked into its content-addressed directory, as the SSH
    backend's sync leaves it (launch/node/sync.py); a copy already there and intact is kept. A failure is
    one line naming the node and its cause, exit 1."""
    import tarfile

    from ddp_train.errors import UserError

    host = socket.gethostname()
    job: dict[str, Any] = json.loads(sys.stdin.buffer.readline())
    try:
        return _stage(job, host)
    except (OSError, ValueError, tarfile.TarError, UserError) as e:
        print(f"ddp-slurm: stage: {host}: {_cause(e)}", flush=True)
    except SystemExit as e:  # launch/node/sync.py's refusals: an unsafe member, a wrong digest
        print(f"ddp-slurm: stage: {host}: {' '.join(str(e.code).split())}", flush=True)
    return 1


def _cause(e: BaseException) -> str:
    """The exception in one line (tarfile's ReadError spans several)."""
    if isinstance(e, OSError) and e.filename:
        text = f"{e.filename}: {e.strerror or e}"
    else:
        text = str(e) if str(e).startswith("/") else f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def _stage(job: Mapping[str, Any], host: str) -> int:
    import base64
    import shutil

    from ddp_train.launch.node import sync
    from ddp_train.storage import create_new, own_dir

    fix = "set ddp_workdir to a directory of yours"
    own_dir(job["logs_in"], fix=fix)
    staged = job.get("stage")
    if not staged:
        return 0
    base, name = os.path.split(staged["dir"].rstrip("/"))
    own_dir(base, fix=fix)
    if sync.inspect(base, name, staged["digest"])["present"]:
        print(f"{staged['dir']}: up to date", flush=True)
        return 0
    tmp = os.path.join(base, f"{name}.tmp-{host}-{os.getpid()}")
    archive = f"{tmp}.tar.gz"
    try:
        with os.fdopen(create_new(archive), "wb") as f:
            f.write(base64.b64decode(staged["tar"], validate=True))
        sync.unpack(base, tmp, archive, "", [])
        sync.finish(base, name, tmp, staged["digest"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(archive)
        raise
    print(f"{staged['dir']}: unpacked", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--node"]:
        node_main()
    if sys.argv[1:] == ["--probe"]:
        sys.exit(probe_main())
    if sys.argv[1:] == ["--stage"]:
        sys.exit(stage_main())
    sys.exit(f"usage: {sys.argv[0]} --node | --probe | --stage (what the driver's srun runs)")
