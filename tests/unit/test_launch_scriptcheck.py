"""The script check: each DDP mistake in a script the test writes is one line `file:line: ...; ...`.

The scripts are read with `ast`, never run: they need neither torch nor a cluster here.
"""

from __future__ import annotations

import ast
import gc
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddp_train.launch.cli import main
from ddp_train.launch.pipeline import check_backend
from ddp_train.launch.plan.scriptcheck import CODES, ScriptCheck, backend_findings, check_script, module_file
from ddp_train.launch.run.logs import JobLog
from tests.testbed import free_port

REPO = Path(__file__).resolve().parents[2]
LOCAL_INV = str(REPO / "inventory" / "local")
LINE = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+): (?P<wrong>[^;]+); (?P<instead>[^;]+)$")

# The how-to's script, completed into a runnable CPU version: its two mistakes are the literal
# init_process_group arguments and model.cuda() with no device chosen per process.
SEED_STYLE = """\
import hashlib
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from mymodel import make_dataset, make_model


def main():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method="tcp://localhost:12345", world_size=4, rank=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model()
    if torch.cuda.is_available():
        model.cuda()
    model = DDP(model)
    data = make_dataset()
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if torch.cuda.is_available():
                x, y = x.cuda(), y.cuda()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    print(f"seed-script: rank={rank} world={world} params_sha256={h.hexdigest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""
# Fixed exactly as the two messages say: the default env://, and set_device before the first CUDA use.
SEED_FIXED = (
    SEED_STYLE.replace("import hashlib\n", "import hashlib\nimport os\n")
    .replace(
        'dist.init_process_group(backend=backend, init_method="tcp://localhost:12345", world_size=4, rank=0)',
        "dist.init_process_group(backend)",
    )
    .replace(
        "    if torch.cuda.is_available():\n        model.cuda()",
        "    if torch.cuda.is_available():\n        torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        "        model.cuda()",
    )
)
HELPER = """\
import torch


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def make_dataset(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
"""

CLEAN = """\
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
model = DDP(torch.nn.Linear(4, 4).cuda(), device_ids=[local_rank])
data = torch.utils.data.TensorDataset(torch.randn(8, 4))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=2, sampler=sampler, shuffle=False)
for epoch in range(2):
    sampler.set_epoch(epoch)
if dist.get_rank() == 0:
    torch.save(model.state_dict(), "ckpt.pt")
dist.destroy_process_group()
"""

# One script per finding 1-7: (code, the script, the line the finding must name).
CASES = {
    "init-args rank": ("init-args", "import torch.distributed as dist\n"
                       'dist.init_process_group("gloo", rank=0)\n', 2),
    "init-args world": ("init-args", "from torch import distributed as dist\ndist.init_process_group(\n"
                        "    'gloo', world_size=2)\n", 2),
    "init-args addr": ("init-args", "import torch.distributed as dist\n\n"
                       "dist.init_process_group('gloo', 'tcp://10.0.0.1:23456')\n", 3),
    "init-args fstring": ("init-args", "import torch.distributed as dist\nport = 1\n"
                          "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}')\n", 3),
    "local-rank": ("local-rank-arg", "import argparse\np = argparse.ArgumentParser()\n"
                   "p.add_argument('--local_rank', type=int, default=0)\n"
                   "lr = p.parse_args().local_rank\n", 3),
    "local-rank dash": ("local-rank-arg", "import argparse\np = argparse.ArgumentParser()\n"
                        "p.add_argument('--local-rank', type=int)\nargs = p.parse_args()\n"
                        "print(args.local_rank)\n", 3),
    "mpi subscript": ("mpi-env", "import os\nrank = int(os.environ['OMPI_COMM_WORLD_RANK'])\n", 2),
    "mpi get": ("mpi-env", "import os\n\nsize = int(os.environ.get('PMI_SIZE', 1))\n", 3),
    "pmix getenv": ("mpi-env", "import os\nr = os.getenv('PMIX_RANK')\n", 2),
    "cuda": ("cuda-device", "import torch\nm = torch.nn.Linear(2, 2)\nm = m.cuda()\n", 3),
    "to cuda": ("cuda-device", "import torch\nx = torch.ones(2)\ny = x.to('cuda')\n", 3),
    "cuda:0": ("cuda-device", "import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
               "x = torch.ones(2, device='cuda:0')\n", 3),
    "device_ids": ("cuda-device", "import torch\nfrom torch.nn.parallel import DistributedDataParallel\n"
                   "m = DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[0])\n", 3),
    "device var": ("cuda-device", "import torch\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
                   "m = torch.nn.Linear(2, 2).to(device)\n", 2),
    "set_epoch": ("set-epoch", "from torch.utils.data import DataLoader, DistributedSampler\n"
                  "s = DistributedSampler([1, 2])\nloader = DataLoader([1, 2], sampler=s)\n", 2),
    "shuffle": ("sampler-shuffle", "from torch.utils.data import DataLoader, DistributedSampler\n"
                "s = DistributedSampler([1])\ns.set_epoch(0)\n"
                "loader = DataLoader([1], shuffle=True, sampler=DistributedSampler([1]))\n", 4),
    "save": ("save-rank", "import torch\nm = torch.nn.Linear(2, 2)\ntorch.save(m.state_dict(), 'c.pt')\n", 3),
    "save in helper": ("save-rank", "import torch\n\n\ndef checkpoint(m):\n    torch.save(m, 'c.pt')\n\n\n"
                       "checkpoint(torch.nn.Linear(2, 2))\n", 5),
}  # fmt: skip


def write(tmp: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    return tmp / next(iter(files))


def assert_lines(check: ScriptCheck) -> None:
    for f in check.findings:
        m = LINE.match(str(f))
        assert m, f"not `file:line: what is wrong; what to write instead`: {f}"
        assert f.code in CODES


@pytest.mark.parametrize("case", CASES)
def test_each_mistake_is_one_line_naming_file_line_and_the_fix(case: str, tmp_path: Path) -> None:
    code, text, line = CASES[case]
    check = check_script(write(tmp_path, {"train.py": text}))
    assert [(f.code, f.line) for f in check.findings] == [(code, line)], [str(f) for f in check.findings]
    assert_lines(check)
    assert str(check.findings[0]).startswith(f"{tmp_path / 'train.py'}:{line}: ")


def test_a_clean_script_has_no_finding(tmp_path: Path) -> None:
    check = check_script(write(tmp_path, {"train.py": CLEAN}))
    assert check.findings == () and check.files == (str(tmp_path / "train.py"),)


@pytest.mark.parametrize(
    "text",
    [
        "import os, argparse\np = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', type=int, default=int(os.environ.get('LOCAL_RANK', 0)))\n",
        "import os\nr = os.environ.get('RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))\n",
        "import os, torch\nlr = int(os.environ['LOCAL_RANK'])\nm = torch.nn.Linear(2, 2).to(f'cuda:{lr}')\n",
        "import os, torch\nlr = int(os.environ['LOCAL_RANK'])\nm = torch.nn.Linear(2, 2).cuda(lr)\n",
        "import torch.distributed as dist\ndist.init_process_group('gloo', init_method='env://')\n",
        "import torch.distributed as dist\ndist.init_process_group('gloo', rank=-1, world_size=-1)\n",
        "from torch.utils.data import DistributedSampler\ns = DistributedSampler([1], shuffle=False)\n",
        "import torch\nimport torch.distributed as dist\n\n\ndef save(m):\n    if dist.get_rank() != 0:\n"
        "        return\n    torch.save(m, 'c.pt')\n",
        "import torch\n\n\ndef save(m):\n    torch.save(m, 'c.pt')\n\n\n"
        "rank = 0\nif rank == 0:\n    save(1)\n",
        "import torch\nrank = 0\ntorch.save({}, f'ckpt-rank{rank}.pt')\n",
        "import os, torch\nlr = int(os.environ['LOCAL_RANK'])\nwith torch.cuda.device(lr):\n"
        "    m = torch.nn.Linear(2, 2).cuda()\n",
        "import os\nos.environ['CUDA_VISIBLE_DEVICES'] = os.environ['LOCAL_RANK']\nimport torch\n"
        "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2).cuda(), device_ids=[0])\n",
        "import io, torch\nbuf = io.BytesIO()\ntorch.save({}, buf)\n",
    ],
    ids=["local_rank-default-from-env", "mpi-as-fallback", "fstring-device", "cuda-index", "env-init",
         "default-minus-one", "no-shuffle", "early-return", "guarded-caller", "file-per-rank",
         "cuda-device-context", "visible-devices-per-process", "in-memory-save"],
)  # fmt: skip
def test_the_right_way_of_each_is_not_a_finding(text: str, tmp_path: Path) -> None:
    check = check_script(write(tmp_path, {"train.py": text}))
    assert check.findings == (), [str(f) for f in check.findings]


def test_seed_style_script_gets_findings_1_and_4_and_none_once_fixed_as_they_say(tmp_path: Path) -> None:
    script = write(tmp_path, {"train.py": SEED_STYLE, "mymodel.py": HELPER})
    check = check_script(script)
    assert [(f.code, f.line) for f in check.findings] == [("init-args", 12), ("cuda-device", 17)]
    assert_lines(check)
    first, second = (str(f) for f in check.findings)
    assert "init_method='tcp://localhost:12345', world_size=4, rank=0" in first and "env://" in first
    assert "model.cuda()" in second and "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))" in second
    script.write_text(SEED_FIXED)
    fixed = check_script(script)
    assert fixed.findings == () and fixed.files == (str(script), str(tmp_path / "mymodel.py"))


def test_readme_script_has_no_finding(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    seed = readme.split("## Bring your own script", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    check = check_script(write(tmp_path, {"train.py": seed, "mymodel.py": HELPER}))
    assert check.findings == () and [b.name for b in check.backends] == ["gloo"]


def test_local_imports_are_followed_with_packages_and_relative_imports(tmp_path: Path) -> None:
    script = write(tmp_path, {
        "proj/scripts/train.py": "import torch\nfrom pkg import trainer\nimport helpers.io as io\n",
        "proj/pkg/__init__.py": "",
        "proj/pkg/trainer.py": "from .dist import setup\n",
        "proj/pkg/dist.py": "import torch.distributed as dist\n\n\ndef setup():\n"
                            "    dist.init_process_group('gloo', world_size=2)\n",
        "proj/helpers/__init__.py": "",
        "proj/helpers/io.py": "import torch\n\n\ndef keep(m):\n    torch.save(m, 'm.pt')\n\n\nkeep(1)\n",
        "proj/unused.py": "import os\nos.environ['PMI_RANK']\n",  # not imported: not read
    })  # fmt: skip
    check = check_script(script, [tmp_path / "proj"])
    shown = {(Path(f.path).relative_to(tmp_path).as_posix(), f.line, f.code) for f in check.findings}
    assert shown == {("proj/pkg/dist.py", 5, "init-args"), ("proj/helpers/io.py", 5, "save-rank")}
    assert not any("unused" in f or "site-packages" in f for f in check.files)
    assert check.files[0] == str(script) and len(check.files) == 6
    alone = check_script(script)  # without the synced root, pkg/ and helpers/ are not local modules
    assert alone.findings == () and alone.files == (str(script),)


def test_ignore_comment_on_the_line_or_statement_silences_that_code_only(tmp_path: Path) -> None:
    text = (
        "import os\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo', rank=0)  # ddp-launch: ignore[init-args]\n"
        "dist.init_process_group(\n    'gloo',\n"
        "    world_size=2,  # ddp-launch: ignore[mpi-env, init-args]\n)\n"
        "r = os.environ['PMI_RANK']  # ddp-launch: ignore[cuda-device]\n"
    )
    check = check_script(write(tmp_path, {"train.py": text}))
    assert [(f.code, f.line) for f in check.findings] == [("mpi-env", 8)]


def test_the_script_is_never_executed_and_bad_files_are_findings(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = write(tmp_path, {
        "train.py": f"import helper\nopen({str(marker)!r}, 'w').write('x')\nraise SystemExit(9)\n",
        "helper.py": "def broken(:\n",
    })  # fmt: skip
    check = check_script(script)
    assert not marker.exists()
    assert [(Path(f.path).name, f.line, f.code) for f in check.findings] == [("helper.py", 1, "syntax")]
    assert_lines(check)
    (tmp_path / "helper.py").write_bytes(b"x = '\xff'\n")
    assert "not UTF-8" in str(check_script(script).findings[0])


@pytest.mark.slow
def test_a_big_project_is_checked_fast(tmp_path: Path) -> None:
    body = "import torch\n\n\ndef f{i}(x):\n    return torch.relu(x) * {i}\n" + "\n".join(
        f"y{j} = [k * {j} for k in range(10)]" for j in range(200)
    )
    files = {"train.py": "\n".join(f"import mod{i}" for i in range(150)) + "\n"}
    files.update({f"mod{i}.py": body.format(i=i) + f"\nimport mod{(i + 1) % 150}\n" for i in range(150)})
    script = write(tmp_path, files)
    # Baseline measured in the same run (this machine is noisy): reading and parsing the same files,
    # the least any ast-based check must do. The check may cost about two parses, not a walk per rule.
    # Both are pure in-process work: compared in CPU time (other pytest-xdist workers on the same cores
    # stretch wall time, not this), best of three interleaved rounds, with the cyclic GC off: its cost
    # grows with everything else the process holds (a pytest worker after hundreds of tests: 4.7x).
    parses, tooks = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            start = time.process_time()
            for path in sorted(tmp_path.glob("*.py")):
                ast.parse(path.read_text(), str(path))
            parses.append(time.process_time() - start)
            start = time.process_time()
            check = check_script(script)
            tooks.append(time.process_time() - start)
            assert len(check.files) == 151 and check.findings == ()
    finally:
        gc.enable()
    parse, took = min(parses), min(tooks)
    assert took < 4 * parse + 0.3, f"{took:.2f}s for 151 files (parsing them alone: {parse:.2f}s)"


def test_backend_names_the_nodes_that_contradict_it(tmp_path: Path) -> None:
    nccl = check_script(
        write(tmp_path, {"a.py": "import torch.distributed as d\nd.init_process_group('nccl')\n"})
    )
    gloo = check_script(
        write(tmp_path, {"b.py": "import torch.distributed as d\nd.init_process_group(backend='gloo')\n"})
    )  # noqa: E501
    [f] = backend_findings(nccl, {"gpu0": 8, "cpu1": 0, "cpu2": 0})
    assert (f.code, f.line) == ("backend", 2) and "cpu1, cpu2 have no usable GPU" in str(f)
    assert LINE.match(str(f)) and "gpu0" not in str(f)
    assert backend_findings(nccl, {"gpu0": 8}) == []
    [g] = backend_findings(gloo, {"n0": 2, "n1": 2})
    assert "n0, n1 have GPUs" in str(g) and LINE.match(str(g))
    assert backend_findings(gloo, {"n0": 0}) == []
    silenced = write(tmp_path, {"c.py": "import torch.distributed as d\nd.init_process_group('nccl')  "
                                        "# ddp-launch: ignore[backend]\n"})  # fmt: skip
    assert backend_findings(check_script(silenced), {"cpu": 0}) == []


def fake_report(gpus: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(checks=[SimpleNamespace(name=n, facts={"gpus": g}) for n, g in gpus.items()])


@pytest.mark.parametrize(("mode", "ok"), [("warn", True), ("strict", False)])
def test_after_preflight_a_backend_without_gpus_warns_or_refuses(mode: str, ok: bool, tmp_path: Path) -> None:
    check = check_script(
        write(tmp_path, {"t.py": "import torch.distributed as d\nd.init_process_group('nccl')\n"})
    )
    plan = SimpleNamespace(script_check=check, script_check_mode=mode)
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        log = JobLog(tmp_path / "logs", "j", console=out)
        assert check_backend(plan, fake_report({"node0": 0, "node1": 2}), log) is ok  # type: ignore[arg-type]
        log.close()
    lines = console.read_text().splitlines()
    assert (
        lines[0]
        == f"{tmp_path / 't.py'}:2: " + str(backend_findings(check, {"node0": 0})[0]).split(": ", 1)[1]
    )
    assert "node0 has no usable GPU" in lines[0] and "node1" not in lines[0]
    assert (len(lines) == 2 and "refuses to launch" in lines[1]) if not ok else len(lines) == 1


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_script_command(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, {"train.py": SEED_STYLE, "mymodel.py": HELPER, "pkg/run.py": CASES["save"][1]})
    code, out, err = run_main(["check-script", "train.py"], capsys)
    assert code == 2 and out.splitlines()[0].startswith("train.py:12: init_process_group hard-codes")
    assert len(out.splitlines()) == 2 and "codes, in order: init-args, cuda-device" in err
    code, out, err = run_main(["check-script", "-m", "pkg.run"], capsys)
    assert code == 2 and out.startswith("pkg/run.py:3: torch.save runs on every rank")
    (tmp_path / "train.py").write_text(SEED_FIXED)
    code, out, err = run_main(["check-script", "train.py"], capsys)
    assert code == 0 and out == "" and err == "script check: no findings in train.py, mymodel.py\n"
    for argv, message in [(["nope.py"], "nope.py: no such file"),
                          (["-m", "no.mod"], "-m no.mod: no no/mod.py"),
                          (["--sync", "nodir", "train.py"], "--sync nodir: not a directory")]:  # fmt: skip
        code, out, err = run_main(["check-script", *argv], capsys)
        assert code == 2 and err.startswith(f"ddp-launch: error: {message}") and err.count("\n") == 1


def test_launch_warns_by_default_and_strict_refuses_with_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, {"train.py": SEED_STYLE, "mymodel.py": HELPER})
    base = ["--hosts", LOCAL_INV, "--dry-run", "--sync", "."]
    code, out, err = run_main([*base, "train.py"], capsys)
    assert code == 0 and out.count("torchrun") == 2
    assert [ln.split(":")[:2] for ln in err.splitlines()[:2]] == [["train.py", "12"], ["train.py", "17"]]
    for strict, why in [
        (["--strict"], "--strict"),
        (["-e", "ddp_script_check=strict"], "ddp_script_check: strict"),
    ]:
        code, out, err = run_main([*base, *strict, "train.py"], capsys)
        *findings, last = err.splitlines()
        assert code == 2 and out == "" and len(findings) == 2 and all(LINE.match(ln) for ln in findings)
        assert last.startswith("ddp-launch: error: script check: 2 finding(s) above (init-args, cuda-device)")
        assert f"and {why} refuses to launch" in last and last.endswith("nothing was started")
    code, out, err = run_main([*base, "-e", "ddp_script_check=off", "--strict", "train.py"], capsys)
    assert code == 2  # --strict wins over the inventory
    code, out, err = run_main([*base, "-e", "ddp_script_check=off", "train.py"], capsys)
    assert code == 0 and err == ""
    code, out, err = run_main([*base, "-e", "ddp_script_check=loud", "train.py"], capsys)
    assert (
        code == 2
        and err.count("\n") == 1
        and "ddp_script_check: 'loud' is not one of strict, warn, off" in err
    )
    (tmp_path / "train.py").write_text(SEED_FIXED)
    code, out, err = run_main([*base, "--strict", "train.py"], capsys)
    assert code == 0 and err == "" and out.count("torchrun") == 2


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the local nodes have GPUs here: nccl is right")
def test_strict_refuses_nccl_on_nodes_without_gpu_after_preflight_with_exit_3(tmp_path: Path) -> None:
    """Finding 8 through the console script: local preflight (no torchrun starts), then exit 3."""
    import subprocess
    import sys

    (tmp_path / "t.py").write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")

    def run() -> subprocess.CompletedProcess:
        port = str(free_port())
        launcher = str(Path(sys.executable).parent / "ddp-launch")
        argv = [
            launcher,
            "--hosts",
            LOCAL_INV,
            "--master-port",
            port,
            "--job-id",
            "sc-b8",
            "--strict",
            "t.py",
        ]
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    res = run()
    if res.returncode != 3 and "address already in use" in (res.stdout + res.stderr).lower():
        res = run()
    assert res.returncode == 3, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[-2].startswith("t.py:2: backend 'nccl' is hard-coded but local0, local1 have no usable GPU")
    assert LINE.match(lines[-2]) and "refuses to launch" in lines[-1] and "nothing was started" in lines[-1]
    assert lines[-2] in (tmp_path / "logs" / "sc-b8" / "launcher.log").read_text()
    assert not list((tmp_path / "logs" / "sc-b8").glob("local*.log"))  # no node output: nothing ran


def test_module_file_finds_what_python_m_runs_in_a_directory_or_a_manifest(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "app").mkdir(parents=True)
    (tmp_path / "pkg" / "app" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("")
    on_disk = lambda rel: (tmp_path / rel).is_file()  # noqa: E731
    assert module_file("pkg.train", on_disk) == "pkg/train.py"
    assert module_file("pkg.app", on_disk) == "pkg/app/__init__.py"  # a package without __main__.py
    assert module_file("pkg.app", on_disk, init=False) is None  # check-script -m: python -m cannot run it
    (tmp_path / "pkg" / "app" / "__main__.py").write_text("")
    assert module_file("pkg.app", on_disk) == "pkg/app/__main__.py"
    assert module_file("pkg.none", on_disk) is None
    assert module_file("a.b", {"a/b/__main__.py": []}.__contains__) == "a/b/__main__.py"
