"""GPU use per node for `ddp-launch status JOB`: one `nvidia-smi --query-gpu` per node over SSH (the
job's inventory, from its command line), summed up as mean/min utilization, memory used and the least
busy GPU. A node whose GPUs average below ddp_gpu_idle_warn (default 20 %) while the job runs is
flagged starving (input pipeline, a straggler's wait, a hung rank); CPU-only nodes show "-"."""

from __future__ import annotations

import shlex
from typing import Any

from ddp_train.launch.preflight.gpuhealth import GpuUse as Gpu
from ddp_train.launch.preflight.gpuhealth import use_cells

FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total")
QUERY = shlex.join(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"])
# Run on the node: no nvidia-smi (CPU-only node) says so instead of failing.
COMMAND = f"command -v nvidia-smi >/dev/null 2>&1 || {{ echo no-nvidia-smi; exit 0; }}; {QUERY}"
HEADERS = ["HOST", "GPUS", "UTIL MEAN/MIN", "MEM USED", "LEAST BUSY", "NOTE"]


def parse(output: str) -> list[Gpu] | None:
    """The GPUs in `nvidia-smi --query-gpu` CSV output; None when the node has none (or no driver)."""
    gpus = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(FIELDS):
            continue
        try:
            gpus.append(Gpu(int(cells[0]), float(cells[1]), float(cells[2]), float(cells[3])))
        except ValueError:  # [N/A] utilization (MIG) and the like: not counted
            continue
    return gpus or None


def row(host: str, gpus: list[Gpu] | None, idle_warn: float, live: bool, error: str = "") -> list[str]:
    """One table row; a live job's node below `idle_warn` percent on average is flagged starving."""
    if error:
        return [host, "?", "?", "?", "?", error]
    if not gpus:
        return [host, "-", "-", "-", "-", ""]
    util, memory = use_cells(gpus)
    mean = sum(g.util for g in gpus) / len(gpus)
    least = min(gpus, key=lambda g: (g.util, g.index))
    flag = f"STARVING (< {idle_warn:g} %)" if live and mean < idle_warn else ""
    return [host, str(len(gpus)), util, memory, f"GPU {least.index} {least.util:.0f} %", flag]


def lines(data: dict[str, Any], live: bool) -> list[str]:
    """The GPU table of a job (job.json `data`), or one line saying why there is none."""
    from ddp_train.launch.jobs.recorded import inventory_nodes
    from ddp_train.launch.remote.fanout import parallel
    from ddp_train.launch.remote.remote import open_session
    from ddp_train.launch.run.logs import table

    wanted = [n.get("host") for n in data.get("nodes") or []]
    try:
        nodes = [n for n in inventory_nodes(str(data.get("job_id")), data) if n.name in wanted]
    except Exception as e:  # noqa: BLE001 - an inventory changed since the launch: say so, keep status
        return [f"gpu: cannot read the job's inventory: {e}"]

    def query(node: Any) -> list[str]:
        try:
            session = open_session(node)
            try:
                code, out = session.exec(COMMAND, timeout=20)
            finally:
                session.close()
        except Exception as e:  # noqa: BLE001 - one node's failure is its row, not the command's
            return row(node.name, None, node.gpu_idle_warn, live, error=str(e).splitlines()[0][:80])
        if code != 0:
            return row(node.name, None, node.gpu_idle_warn, live, error=f"nvidia-smi exit {code}")
        return row(node.name, None if "no-nvidia-smi" in out else parse(out), node.gpu_idle_warn, live)

    return table(HEADERS, parallel(query, nodes)).splitlines()
