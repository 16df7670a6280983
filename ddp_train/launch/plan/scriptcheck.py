"""The script check: DDP mistakes in the user's script and the local modules it imports, read with `ast`.

Nothing is executed. Each finding is one line `file:line: what is wrong; what to write instead`; a
`# ddp-launch: ignore[<code>]` comment on the finding's line (or any line of its statement) silences it.
The backend check (`backend`) needs preflight's GPU facts per node, so it runs after preflight.

This module is the check's API and its report; its parts, each below the next: scriptfiles.py (the
files read and indexed, Finding), scriptflow.py (what a name or `args.x` stands for), scriptfacts.py
(what each node says) and scriptrules.py (the findings that need the whole project).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from ddp_train.launch.plan.scriptfacts import _collect, _Facts
from ddp_train.launch.plan.scriptfiles import Backend, Finding, _ignored_node, _ignored_span, _Project
from ddp_train.launch.plan.scriptrules import (
    _cuda_findings,
    _init_findings,
    _local_rank_findings,
    _save_findings,
)

CODES = {
    "init-args": "init_process_group given a fixed rank, world_size or init_method address (a literal, a "
    "constant, an argparse default, mp.spawn's index or torch.cuda.device_count())",
    "local-rank-arg": "rank read from an argparse --local_rank/--local-rank option torchrun does not pass",
    "mpi-env": "rank or size read from mpirun's environment (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK)",
    "cuda-device": "CUDA used with no device chosen per process (all processes share GPU 0)",
    "set-epoch": "a DistributedSampler and no set_epoch call (every epoch sees the same order)",
    "sampler-shuffle": "DataLoader(shuffle=True, sampler=...): a ValueError on every rank",
    "env-set": "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE or LOCAL_RANK assigned in os.environ "
    "(overrides torchrun's)",
    "spawn": "mp.spawn / mp.Process starting the DDP workers (a single-node launcher, under torchrun)",
    "save-rank": "torch.save not guarded by the global rank (every rank, or once per node, writes the "
    "same file)",
    "backend": "backend hard-coded against the nodes' GPUs (nccl without GPUs, gloo on GPU nodes)",
    "syntax": "a file the check cannot read or parse",
}


@dataclasses.dataclass(frozen=True)
class ScriptCheck:
    """What the check found in the script and its local modules."""

    findings: tuple[Finding, ...]
    files: tuple[str, ...]  # every file read, the script first
    backends: tuple[Backend, ...] = ()

    def summary(self, findings: Sequence[Finding] | None = None) -> str:
        """One line after the findings: how many, their codes in order, how to silence one."""
        found = self.findings if findings is None else findings
        codes = ", ".join(f.code for f in found)
        return (
            f"script check: {len(found)} finding(s) in {len(self.files)} file(s) (codes, in order: {codes}); "
            "silence one with `# ddp-launch: ignore[<code>]` on its line, or set ddp_script_check: off"
        )


def check_script(script: str | Path, roots: Iterable[str | Path] = ()) -> ScriptCheck:
    """Read `script` and the modules it imports from its own directory and `roots` (the synced dir)."""
    script = Path(script).resolve()
    search = [script.parent, *(Path(r).resolve() for r in roots)]
    search = list(dict.fromkeys(search))
    project = _Project(search, shown_base=_shown_base(script, search))
    project.load(script)
    return _check(project)


def module_file(module: str, exists: Callable[[str], bool], init: bool = True) -> str | None:
    """The file `python -m module` runs, relative to its root: pkg/mod.py, else pkg/mod/__main__.py, else
    (with `init`) pkg/mod/__init__.py (read for the script check: it runs first); None when `exists` has
    none of them. `check-script -m` passes init=False: a package without __main__.py cannot be run.

    `exists(rel)`: whether that file is there (a directory on disk, or a --sync manifest's entries)."""
    rel = module.replace(".", "/")
    found = (f"{rel}.py", f"{rel}/__main__.py") + ((f"{rel}/__init__.py",) if init else ())
    return next((f for f in found if exists(f)), None)


def backend_findings(check: ScriptCheck, gpus: Mapping[str, int]) -> list[Finding]:
    """Finding 8: a literal nccl on nodes without a usable GPU, or gloo on nodes with GPUs.

    `gpus`: the GPU count preflight found on each node (0: none usable)."""
    out = []
    without = [n for n, g in gpus.items() if not g]
    with_gpus = [n for n, g in gpus.items() if g]
    for b in check.backends:
        if b.name == "nccl" and without:
            out.append(Finding(b.path, b.line, "backend", (
                f"backend 'nccl' is hard-coded but {', '.join(without)} {_have(without)} no usable GPU "
                "(NCCL needs one per process, the job would fail at its first collective); write "
                "init_process_group('nccl' if torch.cuda.is_available() else 'gloo')")))  # fmt: skip
        elif b.name == "gloo" and with_gpus and not without:
            out.append(Finding(b.path, b.line, "backend", (
                f"backend 'gloo' is hard-coded but {', '.join(with_gpus)} {_have(with_gpus)} GPUs "
                "(gloo moves CUDA tensors through the CPU, many times slower than NCCL); write "
                "init_process_group('nccl' if torch.cuda.is_available() else 'gloo')")))  # fmt: skip
    return out


def _have(nodes: Sequence[str]) -> str:
    return "has" if len(nodes) == 1 else "have"


def _shown_base(script: Path, roots: Sequence[Path]) -> Path:
    """Paths are shown relative to the current directory when inside it, else as they are."""
    try:
        script.relative_to(Path.cwd())
        return Path.cwd()
    except ValueError:
        return Path("/")


def _check(project: _Project) -> ScriptCheck:
    """The findings over every file read, in file and line order, less the ignored ones."""
    facts = _Facts()
    for f in project.files:
        _collect(f, facts)
    found = list(project.errors) + facts.findings
    found += _init_findings(project.files, facts)
    found += _local_rank_findings(project.files, facts)
    found += _cuda_findings(facts)
    if facts.samplers and not facts.set_epoch:
        f, node = facts.samplers[0]
        found.append(Finding(f.shown, node.lineno, "set-epoch", (
            "DistributedSampler without any sampler.set_epoch(epoch) call, so every epoch sees the same "
            "order of samples; call sampler.set_epoch(epoch) at the start of each epoch")))  # fmt: skip
    found += _save_findings(project.files, facts)
    kept = [x for x in found if not _ignored(project, x)]
    kept.sort(key=lambda x: (_order(project, x.path), x.line, x.code))
    backends = [b for b, node, f in facts.backends if not _ignored_node(f, node, "backend")]
    return ScriptCheck(tuple(kept), tuple(f.shown for f in project.files), tuple(backends))


def _order(project: _Project, shown: str) -> int:
    return next((i for i, f in enumerate(project.files) if f.shown == shown), len(project.files))


def _ignored(project: _Project, finding: Finding) -> bool:
    f = next((x for x in project.files if x.shown == finding.path), None)
    if f is None:
        return False
    return finding.code in f.ignores.get(finding.line, ()) or _ignored_span(f, finding)
