"""GPU health before launch: collected by the preflight probe, judged here into one line per GPU.

The probe runs COLLECT on each node (same SSH round trip) and prints the raw outputs of `nvidia-smi
--query-gpu`, `--query-remapped-rows`, the Fabric lines of `nvidia-smi -q`, the Xid lines of the
kernel log and, when opted in (ddp_gpu_health_dcgm), `dcgmi diag -r 1`. Everything else here is a pure
function over those outputs, so the judgement is tested over recorded outputs (tests/unit/fixtures/gpu).

Sources: nvidia-smi(1) (https://docs.nvidia.com/deploy/nvidia-smi/index.html: --query-gpu fields,
--query-remapped-rows, -r); Xid catalogue (https://docs.nvidia.com/deploy/xid-errors/index.html);
A100/H100 memory error management, row remapping
(https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/index.html); Fabric Manager user guide
(https://docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide/index.html); DCGM diagnostics
(https://docs.nvidia.com/datacenter/dcgm/latest/user-guide/dcgm-diagnostics.html).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddp_train.launch.errors import one_line
from ddp_train.launch.node import marked_json
from ddp_train.launch.node.probe import GPU_FIELDS as FIELDS
from ddp_train.launch.node.probe import GPU_MARK as MARK
from ddp_train.launch.node.probe import REMAP_FIELDS

if TYPE_CHECKING:
    from ddp_train.launch.preflight.preflight_model import NodeCheck

NOT_AVAILABLE = ("", "n/a", "[n/a]", "not supported", "[not supported]")
NO_DRIVER = "couldn't communicate with the NVIDIA driver"
RESET = "reset the GPU (nvidia-smi -r -i {index}) or reboot the node"
# Xids that leave the GPU unusable until a reset or reboot (NVIDIA's Xid catalogue, "action"):
FATAL_XID = {
    48: "double-bit ECC error",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    63: "ECC page retirement or row remap recorded",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    **FATAL_XID,
}
XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})[^)]*\): (\d+),")
OFF_BUS_LINE = re.compile(r"NVRM: The NVIDIA GPU ([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.\d")


@dataclasses.dataclass
class Gpu:
    """One GPU as nvidia-smi reports it, with what was found wrong (fatal) or worth a look (warn)."""

    index: str
    bus_id: str
    name: str = ""
    values: dict[str, str] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    remedies: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.bus_id})"

    def problem(self, what: str, remedy: str) -> None:
        self.problems.append(what)
        remedy = remedy.format(index=self.index)
        if remedy not in self.remedies:
            self.remedies.append(remedy)


@dataclasses.dataclass
class Health:
    """The verdict for one node: failures and warnings are one line each, GPU lines name the GPU."""

    gpus: list[Gpu] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    driver: str | None = None
    fabric: str | None = None
    xids: int = 0
    checked: bool = False


# ---- parsing (pure) ---------------------------------------------------------------------------


def probe_args(mode: str, dcgm: bool) -> list[str]:
    """The probe's extra arguments for a node's ddp_gpu_health / ddp_gpu_health_dcgm."""
    if mode == "off":
        return ["--gpu-health-off"]
    return ["--gpu-health-dcgm"] if dcgm else []


def parse_probe_output(out: str) -> dict[str, Any] | None:
    """The collector's record from the probe's output (None: the probe did not run it)."""
    try:
        value = marked_json(out, MARK)
    except ValueError:
        return {"error": "unreadable GPU health record"}
    if value is None:
        return None
    return value if isinstance(value, dict) else {"error": "unreadable GPU health record"}


def bus_key(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of '00000000:3B:00.0' (nvidia-smi) or '0000:3b:00' (kernel log)."""
    m = re.match(r"\s*(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})", text)
    if not m:
        return None
    return int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16)


def parse_csv(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """Rows of `--format=csv,noheader,nounits` output as field -> value (values stripped)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        values = [v.strip() for v in line.split(",")]
        if len(values) == len(fields):
            rows.append(dict(zip(fields, values)))
    return rows


def parse_fabric(text: str) -> dict[tuple[int, int, int], tuple[str, str]]:
    """Per GPU (bus key) the State and Status of the Fabric section of `nvidia-smi -q` (Hopper and
    later; "N/A" without NVSwitches)."""
    out: dict[tuple[int, int, int], tuple[str, str]] = {}
    gpu: tuple[int, int, int] | None = None
    depth: int | None = None  # the Fabric line's indent while inside that section
    for line in text.splitlines():
        m = re.match(r"GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$", line)
        if m:
            gpu, depth = bus_key(m.group(1)), None
            continue
        indent = len(line) - len(line.lstrip())
        if line.strip() == "Fabric":
            depth = indent
            continue
        if depth is None or gpu is None or not line.strip():
            continue
        if indent <= depth:
            depth = None
            continue
        key, _, value = (part.strip() for part in line.partition(":"))
        state, status = out.get(gpu, ("", ""))
        if key == "State" and not state:
            out[gpu] = (value, status)
        elif key == "Status" and not status:
            out[gpu] = (state, value)
    return {k: (state or "N/A", status or "N/A") for k, (state, status) in out.items()}


def parse_xids(lines: Sequence[str]) -> list[tuple[tuple[int, int, int], int, str]]:
    """(bus key, Xid, line) for each 'NVRM: Xid (PCI:0000:3b:00): 79, ...' kernel log line. Newer drivers
    may instead log 'NVRM: The NVIDIA GPU 0000:3b:00.0' with '... fallen off the bus ...' a line or two
    later (github.com/NVIDIA/NVSentinel/issues/155): counted as Xid 79 unless that GPU logged one."""
    found = []
    for line in lines:
        m = XID_LINE.search(line)
        if m:
            key = (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
            found.append((key, int(m.group(4)), line.strip()))
    has_79 = {key for key, xid, _ in found if xid == 79}
    for i, line in enumerate(lines):
        m = OFF_BUS_LINE.search(line)
        if m and any("fallen off the bus" in ln for ln in lines[i : i + 3]):
            key = (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
            if key not in has_79:
                has_79.add(key)
                found.append((key, 79, line.strip()))
    return found


def parse_dcgm(text: str) -> tuple[list[str], list[str]]:
    """(failed tests, warned tests) of `dcgmi diag -r 1`'s result table, each with its first detail."""
    failed: list[str] = []
    warned: list[str] = []
    last: list[str] | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0] or cells[0].startswith("-"):
            continue
        name, result = cells[0], cells[1]
        word = result.split(" ")[0].lower() if result else ""
        if word in ("fail", "warn"):
            last = failed if word == "fail" else warned
            last.append(name)
        elif name.lower() in ("warning", "error", "info") and last and result and " (" not in last[-1]:
            last[-1] = f"{last[-1]} ({one_line(result, 120)})"
        elif word in ("pass", "skip"):
            last = None
    return failed, warned


def _na(value: str | None) -> bool:
    return value is None or value.strip().lower() in NOT_AVAILABLE


def _yes(value: str | None) -> bool:
    v = (value or "").strip().lower()
    return v in ("yes", "true", "enabled") or (v.isdigit() and int(v) > 0)


# ---- judging (pure) ---------------------------------------------------------------------------


def judge(raw: dict[str, Any] | None, whole_gpus: bool = True, torch_gpus: int = 0) -> Health:
    """The verdict over one node's collected record.

    whole_gpus: the job runs one process per whole GPU (not --nproc-per-node cpu): MIG mode on fails."""
    h = Health()
    if raw is None:
        return h
    if "error" in raw:
        h.warnings.append(f"GPU health not checked: the probe's collector failed: {one_line(raw['error'])}")
        return h
    if not raw.get("smi"):
        if raw.get("driver") or torch_gpus:
            h.warnings.append(
                "nvidia-smi not found on PATH: GPU health (ECC, row remaps, MIG, Xid) not checked; "
                "install the NVIDIA driver utilities (role nvidia_driver)"
            )
        return h
    h.checked = True
    code, out, fields = raw.get("query") or [None, "", list(FIELDS)]
    rows = parse_csv(out, fields)
    if (
        code != 0
    ):  # with rows: one GPU unreadable ("Unable to determine the device handle ..."), the rest judged
        h.failures.append(_smi_failure(code, out, rows))
        if not rows:
            return h
    if not rows:
        h.warnings.append("nvidia-smi lists no GPU")
        return h
    h.gpus = [
        Gpu(index=r.get("index", str(i)), bus_id=r.get("pci.bus_id", "?"), name=r.get("name", ""), values=r)
        for i, r in enumerate(rows)
    ]
    h.driver = rows[0].get("driver_version")
    by_bus = {bus_key(g.bus_id): g for g in h.gpus}
    for g in h.gpus:
        _judge_query(g, whole_gpus)
    _judge_remap(raw.get("remap"), by_bus)
    _judge_fabric(raw, by_bus, h)
    _judge_xids(raw.get("kernel_log") or {}, by_bus, h)
    _judge_dcgm(raw, h)
    for g in h.gpus:
        if g.problems:
            h.failures.append(f"{g.label}: {'; '.join(g.problems)}; fix: {' / '.join(g.remedies)}")
        if g.notes:
            h.warnings.append(f"{g.label}: {'; '.join(g.notes)}")
    return h


def _smi_failure(code: Any, out: str, rows: Sequence[dict] = ()) -> str:
    if rows:  # the lines that are not GPU rows say what went wrong
        out = "\n".join(ln for ln in out.splitlines() if ln.count(",") + 1 != len(rows[0]))
    text = one_line(out.strip(), 200) or f"exit {code}"
    if NO_DRIVER in out:
        return (
            "nvidia-smi cannot talk to the NVIDIA driver (the kernel module is not loaded): load it "
            "(modprobe nvidia) or reboot into the installed driver (role nvidia_driver)"
        )
    if "version mismatch" in out.lower():
        return f"nvidia-smi: {text}: the loaded kernel module is not the installed driver; reboot the node"
    return f"nvidia-smi failed (exit {code}): {text}"


def _judge_query(g: Gpu, whole_gpus: bool) -> None:
    v = g.values
    for field, value in v.items():
        if "reset" in value.lower():  # e.g. "[GPU requires reset]" in place of a value
            g.problem(f"{field} reads {value}", RESET)
            return
    ecc = v.get("ecc.errors.uncorrected.volatile.total")
    if not _na(ecc) and ecc and ecc.isdigit() and int(ecc) > 0:
        g.problem(f"{ecc} uncorrectable ECC error(s) since the driver loaded", RESET)
    if _yes(v.get("retired_pages.pending")):
        g.problem("a page retirement is pending", RESET)
    mig = v.get("mig.mode.current")
    if mig and mig.lower() == "enabled":
        if whole_gpus:
            g.problem(
                "MIG mode is on but the job uses whole GPUs (NCCL does not run across MIG instances)",
                "nvidia-smi -i {index} -mig 0, then reset the GPU",
            )
        else:
            g.notes.append("MIG mode is on")
    pm = v.get("persistence_mode")
    if pm and pm.lower() == "disabled":
        g.notes.append(
            "persistence mode is off (each job start re-initialises the GPU): "
            "systemctl enable --now nvidia-persistenced (role nvidia_driver)"
        )


def _judge_remap(remap: Any, by_bus: dict) -> None:
    if not remap or remap[0] != 0:
        return  # no row remapper (pre-Ampere, consumer GPUs): nothing to judge
    for r in parse_csv(remap[1], REMAP_FIELDS):
        g = by_bus.get(bus_key(r["gpu_bus_id"]))
        if g is None:
            continue
        if _yes(r["remapped_rows.failure"]):
            g.problem("row remapping failed (no spare rows left)", "drain the node and replace the GPU (RMA)")
        elif _yes(r["remapped_rows.pending"]):
            g.problem("a row remap is pending", RESET)


def _judge_fabric(raw: dict, by_bus: dict, h: Health) -> None:
    fabric = raw.get("fabric")
    states = parse_fabric(fabric[1]) if fabric and fabric[0] == 0 else {}
    active = {k: v for k, v in states.items() if v[0].upper() != "N/A"}
    fm = "systemctl enable --now nvidia-fabricmanager (its version must equal the driver's)"
    for key, (state, status) in active.items():
        g = by_bus.get(key)
        if g is None:
            continue
        if state.lower() != "completed":
            g.problem(f"NVSwitch fabric state is {state!r} (Fabric Manager has not set it up)", fm)
        elif status.lower() != "success":
            g.problem(f"NVSwitch fabric setup ended with {status!r}", fm)
    if active:
        h.fabric = "ok" if all(s.lower() == "completed" for s, _ in active.values()) else "not ready"
    service = raw.get("fm_service")
    if raw.get("nvswitches") and not active and service is not None:
        # NVSwitch systems before Hopper report no fabric state: ask systemd about Fabric Manager
        h.fabric = (service[1].strip() or "?") if service[0] != 0 else "ok"
        if service[0] != 0:
            h.failures.append(
                f"{raw['nvswitches']} NVSwitches but nvidia-fabricmanager is "
                f"{one_line(service[1]) or 'not active'}: {fm}"
            )


def _judge_xids(log: dict, by_bus: dict, h: Health) -> None:
    if "error" in log:
        h.warnings.append(
            f"cannot read the kernel log ({one_line(log['error'], 200)}): Xid errors not checked; "
            "run as root or add the user to the adm/systemd-journal group"
        )
        return
    seen: dict[Any, dict[int, int]] = {}
    for key, xid, _line in parse_xids(log.get("lines") or []):
        seen.setdefault(key, {}).setdefault(xid, 0)
        seen[key][xid] += 1
    for key, counts in seen.items():
        h.xids += sum(counts.values())
        g = by_bus.get(key)
        if g is None:  # a GPU nvidia-smi no longer lists (fallen off the bus)
            g = Gpu(index="?", bus_id="{:08X}:{:02X}:{:02X}.0".format(*key))
            h.gpus.append(g)
        text = ", ".join(
            f"{x} {XID_NAMES.get(x, '')}".rstrip() + (f" x{n}" if n > 1 else "") for x, n in counts.items()
        )
        fatal = sorted(x for x in counts if x in FATAL_XID)
        if fatal:
            remedy = (
                "reboot the node (check power, cooling and seating first)" if 79 in fatal else RESET
            ) + "; the kernel log keeps the line until reboot (ddp_gpu_health: warn to launch anyway)"
            g.problem(f"Xid {text} in the kernel log since boot", remedy)
        else:
            g.notes.append(f"Xid {text} in the kernel log since boot")


def _judge_dcgm(raw: dict, h: Health) -> None:
    if "dcgm" not in raw:
        return
    res = raw["dcgm"]
    if res is None:
        h.warnings.append("ddp_gpu_health_dcgm is set but dcgmi is not installed (datacenter-gpu-manager)")
        return
    code, out = res
    failed, warned = parse_dcgm(out)
    if failed:
        h.failures.append(f"dcgmi diag -r 1 failed: {', '.join(failed)}")
    elif code != 0:
        h.warnings.append(
            f"dcgmi diag -r 1 did not run (exit {code}: {one_line(out.strip(), 160)}); "
            "is nv-hostengine running? (systemctl start nvidia-dcgm)"
        )
    if warned:
        h.warnings.append(f"dcgmi diag -r 1 warns: {', '.join(warned)}")


# ---- hooks into preflight and doctor ----------------------------------------------------------


def verdict(c: NodeCheck) -> Health:
    """The verdict over a probed node (a preflight.NodeCheck); CPU jobs (--nproc-per-node cpu) may
    run on GPUs in MIG mode."""
    raw = c.facts.get("gpu_health")
    return judge(raw, whole_gpus=c.plan.nproc != "cpu", torch_gpus=c.facts.get("gpus") or 0)


def strict(c: NodeCheck) -> bool:
    """Whether the node's GPU problems fail preflight (ddp_gpu_health: strict, and a GPU job)."""
    return c.plan.node.gpu_health == "strict" and c.plan.nproc != "cpu"


def check(c: NodeCheck) -> None:
    """Preflight: add a probed node's GPU failures and warnings (failures only warn with
    ddp_gpu_health: warn, or for a CPU job)."""
    health = verdict(c)
    for line in health.failures:
        (c.fail if strict(c) else c.warnings.append)(line)
    c.warnings.extend(health.warnings)


def render(checks: Sequence[NodeCheck]) -> str | None:
    """Doctor: one row per GPU node (None when no node has an NVIDIA GPU)."""
    from ddp_train.launch.run.logs import table

    rows = []
    for c in checks:
        if not c.facts:
            continue
        h = verdict(c)
        if not h.checked:
            continue
        gpus = [g for g in h.gpus if g.index != "?"]
        bad = sum(1 for g in h.gpus if g.problems)

        def count(field: str, want: str, gpus: list[Gpu] = gpus) -> str:
            return f"{sum(1 for g in gpus if g.values.get(field, '').lower() == want)}/{len(gpus)}"

        rows.append(
            [
                c.name,
                len(gpus),
                h.driver,
                count("persistence_mode", "enabled"),
                count("mig.mode.current", "enabled"),
                h.fabric or "n/a",
                h.xids,
                *_use(gpus),
                "ok" if not h.failures else f"{'FAIL' if strict(c) else 'warn'} ({bad or len(h.failures)})",
            ]
        )
    if not rows:
        return None
    headers = ["HOST", "GPUS", "DRIVER", "PERSIST", "MIG", "FABRIC", "XID", "UTIL MEAN/MIN", "MEM USED"]
    return table([*headers, "GPU_HEALTH"], rows)


def _use(gpus: list[Gpu]) -> tuple[str, str]:
    """Doctor's GPU use cells, as `status` shows them: what already runs on the GPUs (another user's
    job); "-" where nvidia-smi did not report the fields ([N/A], an older driver)."""
    try:
        use = [
            GpuUse(
                i,
                float(g.values["utilization.gpu"]),
                float(g.values["memory.used"]),
                float(g.values["memory.total"]),
            )
            for i, g in enumerate(gpus)
        ]
    except (KeyError, ValueError):
        return "-", "-"
    return use_cells(use) if use else ("-", "-")


@dataclasses.dataclass(frozen=True)
class GpuUse:
    """One GPU's use: doctor's columns here, `status`'s (launch/jobs/gpuuse.py)."""

    index: int
    util: float  # percent
    used_mib: float
    total_mib: float


def use_cells(gpus: list[GpuUse]) -> tuple[str, str]:
    """("MEAN/MIN %", "USED/TOTAL GiB") over a node's GPUs: status's columns, and doctor's."""
    utils = [g.util for g in gpus]
    used = sum(g.used_mib for g in gpus) / 1024
    total = sum(g.total_mib for g in gpus) / 1024
    return f"{sum(utils) / len(utils):.0f}/{min(utils):.0f} %", f"{used:.1f}/{total:.0f} GiB"
