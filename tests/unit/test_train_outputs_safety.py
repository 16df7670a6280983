"""The trainer's own outputs never follow another user's symlink (issue #44): the run and checkpoint
directories are made or checked as this user's (not writable by group or others; a symbolic link on the
way only the user's own or root's), files are opened O_NOFOLLOW, temp files O_EXCL. A refusal is one
line naming the path, exit 2; the victim file is never written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from ddp_train import checkpoint, distributed, exitcodes, storage, trainer
from ddp_train.config import load_config

NOBODY = 65534
VICTIM = "the victim's own bytes\n"
QUICK = ["train.max_steps=2", "eval.interval_steps=0", "checkpoint.interval_steps=0", "log.interval_steps=1"]


@pytest.fixture(autouse=True)
def _as_root(monkeypatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a path to another user needs root")
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)  # run() sets them in os.environ


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM)
    return path


def train(capsys, run_dir: Path | str, *overrides: str) -> tuple[int, str]:
    cfg = load_config(None, [f"run.dir={run_dir}", *QUICK, *overrides])
    code = trainer.run(cfg)
    return code, capsys.readouterr().err


def error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "ddp-train: error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def theirs(path: Path, mode: int = 0o777) -> Path:
    """A directory another user made first (as root, the test gives it away)."""
    path.mkdir(parents=True)
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_planted_symlink_in_the_run_directory_is_never_written_through(tmp_path, capsys, name) -> None:
    target = victim(tmp_path)
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / name).symlink_to(target)
    code, err = train(capsys, tmp_path / "runs")
    assert target.read_text() == VICTIM
    assert code == exitcodes.BAD_INPUT
    line = error_line(err)
    assert f"{run / name}: a symbolic link" in line and "never written through" in line, line


def test_the_index_dump_is_never_written_through_a_symlink(tmp_path, capsys) -> None:
    target = victim(tmp_path)
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / "indices-rank0.jsonl").symlink_to(target)
    code, err = train(capsys, tmp_path / "runs", "debug.dump_indices=true")
    assert target.read_text() == VICTIM
    assert code == exitcodes.BAD_INPUT and "indices-rank0.jsonl: a symbolic link" in error_line(err)


def test_a_planted_best_pt_temp_file_is_replaced_not_followed(tmp_path, capsys) -> None:
    target = victim(tmp_path)
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / "best.pt.tmp").symlink_to(target)
    code, err = train(capsys, tmp_path / "runs", "eval.interval_steps=2")
    assert code == 0, err
    assert target.read_text() == VICTIM
    assert stat.S_ISREG(os.lstat(run / "best.pt").st_mode)
    assert checkpoint.load_latest(run / "checkpoints") is not None


def test_checkpoint_and_replica_temp_files_are_created_new(tmp_path) -> None:
    target = victim(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step-00000003.pt.tmp").symlink_to(target)
    path = checkpoint.save({"format": checkpoint.FORMAT, "w": torch.zeros(3)}, ck, 3)
    assert target.read_text() == VICTIM and stat.S_ISREG(os.lstat(path).st_mode)
    info = checkpoint.replica_info(path)
    Path(f"{info}.tmp").symlink_to(target)
    checkpoint.write_replica_info(path, {"sha256": "0" * 64, "from": "h"})
    assert target.read_text() == VICTIM and stat.S_ISREG(os.lstat(info).st_mode)
    assert oct(stat.S_IMODE(os.lstat(path).st_mode)) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_run_directory_another_user_made_is_refused(tmp_path, capsys) -> None:
    target = victim(tmp_path)
    run = theirs(tmp_path / "runs" / "default")
    (run / "config.yaml").symlink_to(target)
    os.lchown(run / "config.yaml", NOBODY, NOBODY)
    code, err = train(capsys, tmp_path / "runs")
    assert target.read_text() == VICTIM
    assert code == exitcodes.BAD_INPUT
    line = error_line(err)
    assert f"ddp-train: error: {run}: belongs to uid {NOBODY}, not to you (uid 0)" in line, line
    assert "set run.dir to a directory of yours" in line


def test_a_group_writable_run_directory_of_ours_is_refused_naming_the_fix(tmp_path, capsys) -> None:
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    run.chmod(0o775)
    code, err = train(capsys, tmp_path / "runs")
    assert code == exitcodes.BAD_INPUT
    line = error_line(err)
    assert f"{run}: writable by group or others (mode 0775)" in line and f"chmod go-w {run}" in line, line


def test_another_users_symlink_on_the_way_is_refused(tmp_path, capsys) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    link = tmp_path / "runs"
    link.symlink_to(mine)
    os.lchown(link, NOBODY, NOBODY)
    code, err = train(capsys, link)
    assert code == exitcodes.BAD_INPUT
    assert f"{link}: a symbolic link of uid {NOBODY}" in error_line(err)
    assert list(mine.iterdir()) == []


def test_the_users_own_symlinks_keep_working(tmp_path, capsys) -> None:
    scratch = tmp_path / "scratch" / "me"
    scratch.mkdir(parents=True)
    (tmp_path / "runs").symlink_to(scratch)  # run.dir -> /scratch/me
    code, err = train(capsys, tmp_path / "runs")
    assert code == 0, err
    assert (scratch / "default" / "metrics.jsonl").is_file()
    assert checkpoint.list_checkpoints(scratch / "default" / "checkpoints")
    # and the run directory itself a link of the user's to a directory of theirs
    (tmp_path / "other").mkdir()
    (tmp_path / "runs2").mkdir()
    (tmp_path / "runs2" / "default").symlink_to(tmp_path / "other")
    code, err = train(capsys, tmp_path / "runs2")
    assert code == 0, err
    assert (tmp_path / "other" / "config.yaml").is_file()


def test_a_shared_scratch_parent_is_fine_when_sticky(tmp_path, capsys) -> None:
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: others cannot rename what is ours
    code, err = train(capsys, shared / "runs")
    assert code == 0, err
    assert stat.S_IMODE(os.lstat(shared / "runs" / "default").st_mode) & 0o022 == 0
    shared.chmod(0o777)  # anyone can move our run directory away and put theirs in its place
    code, err = train(capsys, shared / "runs")
    assert code == exitcodes.BAD_INPUT
    assert f"{shared}: a parent of" in error_line(err) and "without the sticky bit" in error_line(err)


def test_flight_recorder_dump_directories_are_the_users_own(tmp_path) -> None:
    other = theirs(tmp_path / "shared" / "dumps")
    with pytest.raises(storage.RefusedPath, match=f"^{other}: belongs to uid {NOBODY}"):
        distributed.make_dump_dirs({"TORCH_FR_DUMP_TEMP_FILE": f"{other}/trace_"})
    with pytest.raises(storage.RefusedPath, match="set TORCH_NCCL_DEBUG_INFO_TEMP_FILE to a path in a"):
        distributed.make_dump_dirs({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{other}/trace_"})
    distributed.make_dump_dirs({"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path / 'mine' / 'd'}/trace_"})
    assert (tmp_path / "mine" / "d").is_dir()


def test_files_the_trainer_writes_refuse_another_users_file(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("theirs\n")
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(storage.RefusedPath, match=f"^{path}: belongs to uid {NOBODY}"):
        storage.open_output(path, "a", encoding="utf-8")
    assert path.read_text() == "theirs\n"


def test_stack_dumps_land_only_in_a_private_directory_of_the_users(tmp_path, monkeypatch) -> None:
    """stackdump shares the helpers (storage.own_dir, storage.create_new): same behaviour as before."""
    import atexit

    from ddp_train import stackdump

    monkeypatch.setattr(atexit, "register", lambda *a: None)
    mine = tmp_path / "agent"
    mine.mkdir(mode=0o700)
    (mine / "r1.txt").symlink_to(victim(tmp_path))  # a leftover name: removed, never followed
    link = tmp_path / "link"
    link.symlink_to(mine)
    for directory, made in ((theirs(tmp_path / "other", 0o700), False), (link, False), (mine, True)):
        monkeypatch.setenv(stackdump.STACK_DIR_ENV, str(directory))
        monkeypatch.setattr(stackdump, "_file", None)
        stackdump.install(1)
        try:
            assert (stackdump._file is not None) == made, directory
        finally:
            if stackdump._file is not None:
                stackdump._file.close()
            monkeypatch.setattr(stackdump, "_file", None)
    assert (tmp_path / "victim.txt").read_text() == VICTIM
    st = os.lstat(mine / "r1.txt")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert not (tmp_path / "other" / "r1.txt").exists()
