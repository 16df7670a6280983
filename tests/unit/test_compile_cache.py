"""torch.compile's caches only this user can write (issue #44): inductor's generated modules and shared
objects, torch's default cache directory ($TMPDIR/torchinductor_<user>) and Triton's kernels, made 0700
or refused in one line when another user made them first, by the node agent and by the trainer."""

from __future__ import annotations

import getpass
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train import cachedirs
from ddp_train.config import load_config

NOBODY = 65534


def default_dir(tmp: Path) -> Path:
    return tmp / f"torchinductor_{getpass.getuser()}"


def theirs(path: Path, mode: int = 0o777) -> Path:
    """A directory another user made first (as root, the test gives it away)."""
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    return path


def env(tmp: Path, **more: str) -> dict[str, str]:
    return {"TMPDIR": str(tmp), "USER": getpass.getuser(), **more}


def mode_and_owner(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")


def test_the_caches_are_made_0700_and_the_users_own(tmp_path: Path) -> None:
    got = cachedirs.compile_cache_env(env(tmp_path))
    inductor = default_dir(tmp_path)
    assert got == {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(inductor / "triton")}
    for path in (inductor, inductor / "triton"):
        assert mode_and_owner(path) == (0o700, os.geteuid()), path


def test_another_users_default_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    made = theirs(default_dir(tmp_path), 0o755)
    with pytest.raises(cachedirs.CacheDirError) as e:
        cachedirs.compile_cache_env(env(tmp_path))
    line = str(e.value)
    assert line.startswith(f"compile cache: TMPDIR: {made} belongs to uid {NOBODY}, not to you"), line
    assert "\n" not in line and "set TMPDIR (in ddp_env) to a directory of yours" in line
    assert not (made / "triton").exists()


def test_a_users_own_cache_dir_is_checked_not_replaced(tmp_path: Path) -> None:
    mine = tmp_path / "mine" / "inductor"
    got = cachedirs.compile_cache_env(env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(mine)))
    assert got == {"TORCHINDUCTOR_CACHE_DIR": str(mine), "TRITON_CACHE_DIR": str(mine / "triton")}
    assert mode_and_owner(mine) == (0o700, os.geteuid()) and mode_and_owner(mine.parent)[0] == 0o700
    # torch uses its default directory whatever the variable says
    assert mode_and_owner(default_dir(tmp_path)) == (0o700, os.geteuid())
    other = theirs(tmp_path / "shared")
    refused = r"^compile cache: {}: .*shared belongs"
    with pytest.raises(cachedirs.CacheDirError, match=refused.format("TORCHINDUCTOR_CACHE_DIR")):
        cachedirs.compile_cache_env(env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(other)))
    with pytest.raises(cachedirs.CacheDirError, match=refused.format("TRITON_CACHE_DIR")):
        cachedirs.compile_cache_env(env(tmp_path, TRITON_CACHE_DIR=str(other)))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p.mkdir(mode=0o777) or p.chmod(0o777), r"is writable by group or others \(mode 0777\)"),
        (lambda p: p.symlink_to(p.parent / "elsewhere"), r"is a symbolic link"),
        (lambda p: p.write_text(""), r"is not a directory"),
    ],
    ids=["group-writable", "symlink", "file"],
)
def test_a_writable_directory_a_symlink_or_a_file_is_refused(tmp_path: Path, make, why: str) -> None:
    (tmp_path / "elsewhere").mkdir()
    make(default_dir(tmp_path))
    with pytest.raises(cachedirs.CacheDirError, match=why):
        cachedirs.compile_cache_env(env(tmp_path))
    assert list((tmp_path / "elsewhere").iterdir()) == []  # never followed


def test_a_parent_others_can_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(cachedirs.CacheDirError, match=r"shared, a parent of the cache, is writable by group"):
        cachedirs.compile_cache_env(env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(shared / "c")))
    shared.chmod(0o1777)  # sticky, as /tmp: only the owner of an entry can rename or remove it
    cachedirs.compile_cache_env(env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(shared / "c")))
    assert mode_and_owner(shared / "c") == (0o700, os.geteuid())


def test_the_users_own_directory_torch_made_0755_is_narrowed(tmp_path: Path) -> None:
    inductor = default_dir(tmp_path)
    inductor.mkdir()
    inductor.chmod(0o755)
    cachedirs.compile_cache_env(env(tmp_path))
    assert mode_and_owner(inductor) == (0o700, os.geteuid())


def test_the_default_directory_is_torchs_own() -> None:
    """The same path torch 2.13 computes (_inductor/runtime/cache_dir_utils.py default_cache_dir)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert cachedirs.default_cache_dir(os.environ) == default_cache_dir()


def node_env(tmp_path: Path, **more: str) -> dict[str, str]:
    """The agent's own environment: this one's, less cache variables an earlier test (torch) set here."""
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return {**base, "TMPDIR": str(tmp_path), **more}


def agent(tmp_path: Path, script: str, job_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    torchrun = tmp_path / "torchrun.py"
    torchrun.write_text(script)
    return subprocess.run(
        [sys.executable, "-m", "ddp_train.agent", str(torchrun)],
        input=json.dumps(job_env) + "\n", capture_output=True, text=True, timeout=60,
        env=node_env(tmp_path, DDP_JOB_ID="cache"),
    )  # fmt: skip


def test_the_agent_gives_torchrun_private_caches(tmp_path: Path) -> None:
    res = agent(
        tmp_path,
        "import json, os\nprint(json.dumps([os.environ.get(v) for v in "
        "('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR')]))\n",
        {},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    inductor, triton = json.loads(res.stdout.strip().splitlines()[-1])
    assert inductor == str(default_dir(tmp_path)) and triton == f"{inductor}/triton"
    for path in (inductor, triton):
        assert mode_and_owner(Path(path)) == (0o700, os.geteuid()), path


def test_the_agent_refuses_another_users_cache_dir_before_torchrun_starts(tmp_path: Path) -> None:
    made = theirs(tmp_path / "theirs")
    res = agent(tmp_path, "print('torchrun ran')\n", {"TORCHINDUCTOR_CACHE_DIR": str(made)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        f"ddp-agent: error: compile cache: TORCHINDUCTOR_CACHE_DIR: {made} belongs to uid {NOBODY}, not to "
        f"you (uid 0): whoever made it can put code there that the ranks run; set TORCHINDUCTOR_CACHE_DIR "
        "(in ddp_env) to a directory of yours"
    ]


def test_the_trainer_refuses_another_users_default_cache_dir(tmp_path, monkeypatch, capsys) -> None:
    """Compiled, each rank checks too (torchrun started by hand, without the agent): exit 2, one line."""
    import torch

    from ddp_train.trainer import run

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    made = theirs(default_dir(tmp_path))
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", "train.compile=true", "train.max_steps=1"])
    assert run(cfg) == 2
    err = capsys.readouterr().err
    assert f"ddp-train: error: compile cache: TMPDIR: {made} belongs to uid {NOBODY}" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_compiled_rank_under_the_agent_writes_its_caches_in_private_directories(tmp_path: Path) -> None:
    """A user script that compiles, through the agent and torchrun: inductor writes its generated code in
    the agent's 0700 directories (before: $TMPDIR/torchinductor_<user> made 0755 by torch)."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, torch\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "f = torch.compile(lambda x: (x * 2).sin().sum())\n"
        "f(torch.ones(8))\n"
        "print(json.dumps([cache_dir(), os.environ['TRITON_CACHE_DIR']]))\n"
    )
    torchrun = Path(sys.executable).parent / "torchrun"
    res = subprocess.run(
        [sys.executable, "-m", "ddp_train.agent", str(torchrun), "--standalone", "--nproc-per-node", "1",
         str(script)],
        input="{}\n", capture_output=True, text=True, timeout=600,
        env=node_env(tmp_path, DDP_JOB_ID="compiled", OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    inductor, triton = json.loads(res.stdout.strip().splitlines()[-1])
    assert inductor == str(default_dir(tmp_path))
    for path in (inductor, triton):
        assert mode_and_owner(Path(path)) == (0o700, os.geteuid()), path
    written = [p for p in Path(inductor).rglob("*") if p.is_file()]
    assert any(p.suffix == ".py" for p in written), written  # the generated module, where only we write
    assert all(os.lstat(p).st_uid == os.geteuid() for p in written)
