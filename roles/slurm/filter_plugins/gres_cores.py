"""gres.conf Cores= of each GPU, from what tasks/facts.yml reads on a node (sysfs and the NVIDIA driver).

Without NVML (EPEL's and Debian's Slurm are built without it) slurmd learns nothing of a GPU's CPU affinity,
so gres.conf must name it: `Cores=` "Specify the first thread CPU index numbers for the specific cores
which can use this resource", in Slurm's logical core index, "not the physical core index ... Core 0 will
be the first core on the first socket, while core 1 will be the second core on the first socket. This
numbering coincides with the logical core number (Core L#) seen in lstopo -l" (gres.conf(5), Cores;
https://slurm.schedmd.com/gres.conf.html). hwloc numbers its objects in tree order, each level's children
sorted by their CPU sets, so the logical index of a core is its rank when cores are sorted by (the first
CPU of its package, its own first CPU). The OS's CPU ids are not core indexes: with SMT both threads of a
core (CPUs 0 and 48, say) are one core, and a BIOS may number the sockets' CPUs alternately (0, 2, 4 on the
first socket).

Input lines (tasks/facts.yml):
  gpu <PCI slot> <device minor | -> <local_cpulist | ->   sysfs /sys/bus/pci/devices/<slot>/local_cpulist
      (Linux Documentation/ABI/testing/sysfs-bus-pci: the CPUs local to the device, a cpulist such as
      "0-23,48-71") and the NVIDIA driver's /proc/driver/nvidia/gpus/<slot>/information "Device Minor:"
      (the N of /dev/nvidiaN, NVIDIA driver README "Using the /proc File System Interface");
  cpu <id> <physical_package_id> <core_id>                 sysfs /sys/devices/system/cpu/cpu<id>/topology
"""

from __future__ import annotations


def _cpulist(text: str) -> set[int]:
    """A kernel cpulist ("0-3,8,10-11") as a set; ValueError on anything else."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _ranges(ids: list[int]) -> str:
    """Sorted ints as Slurm's range list: [0, 1, 2, 5] -> "0-2,5"."""
    out, start, prev = [], None, None
    for i in sorted(set(ids)):
        if start is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


def slurm_gpu_cores(lines: list[str], gpus: int) -> list[dict]:
    """[{"files": "[0-3]" | "0", "cores": "0-23" | ""}, ...]: the node's GPUs by device minor, consecutive
    ones with the same cores together. [] (no Cores=, the plain File= line) unless the driver named the minors
    0..gpus-1 of exactly `gpus` GPUs; a GPU whose CPUs or cores are unknown gets cores "" (no Cores=)."""
    cpus: dict[int, tuple[int, int]] = {}
    found: dict[int, str] = {}
    for line in lines or []:
        f = str(line).split()
        try:
            if len(f) == 4 and f[0] == "cpu":
                cpus[int(f[1])] = (int(f[2]), int(f[3]))
            elif len(f) == 4 and f[0] == "gpu" and f[2] != "-":
                found[int(f[2])] = f[3]
        except ValueError:
            return []
    if sorted(found) != list(range(int(gpus))):
        return []
    package_first: dict[int, int] = {}
    core_first: dict[tuple[int, int], int] = {}
    for cpu, (pkg, core) in cpus.items():
        package_first[pkg] = min(cpu, package_first.get(pkg, cpu))
        core_first[(pkg, core)] = min(cpu, core_first.get((pkg, core), cpu))
    order = sorted(core_first, key=lambda k: (package_first[k[0]], core_first[k]))
    index = {key: i for i, key in enumerate(order)}
    cores: list[str] = []
    for minor in range(int(gpus)):
        try:
            local = _cpulist(found[minor]) if found[minor] != "-" else set()
        except ValueError:
            local = set()
        # the online ones (an offline CPU has no topology/ and is no CPU of slurmd's)
        ids = [index[cpus[c]] for c in local if c in cpus]
        cores.append(_ranges(ids))
    groups: list[dict] = []
    start = 0
    for minor in range(1, int(gpus) + 1):
        if minor == int(gpus) or cores[minor] != cores[start]:
            files = f"[{start}-{minor - 1}]" if minor - 1 > start else str(start)
            groups.append({"files": files, "cores": cores[start]})
            start = minor
    return groups


class FilterModule:
    def filters(self):
        return {"slurm_gpu_cores": slurm_gpu_cores}
