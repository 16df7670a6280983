"""log.prometheus: rank 0's latest step metrics in a node exporter textfile, replaced atomically."""

from __future__ import annotations

import logging
import os
import pwd
from pathlib import Path

import pytest

from ddp_train.config import ConfigError, load_config
from ddp_train.metrics import JsonlWriter, PromTextfile, open_outputs


def _samples(path: Path) -> dict[str, float]:
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}


def test_the_textfile_holds_the_latest_step_and_the_last_val_loss(tmp_path: Path) -> None:
    prom = tmp_path / "textfile" / "ddp_train.prom"
    prom.parent.mkdir()
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=r1", "log.prometheus=true",
                             f"log.prometheus_textfile={prom}"])  # fmt: skip
    _, writer = open_outputs(cfg, True, logging.getLogger("t"))
    assert isinstance(writer, PromTextfile)
    writer.write(
        {"step": 10, "loss": 2.5, "val_loss": 2.75, "tokens_per_s": 12345.5, "mfu": 0.41, "lr": 1e-3}
    )
    writer.write({"step": 20, "loss": 2.25, "tokens_per_s": 13000.0, "mfu": 0.42, "grad_norm": None})
    s = _samples(prom)
    run = f'{{run="{cfg.run_dir.name}",user="{pwd.getpwuid(os.geteuid()).pw_name}"}}'
    assert s[f"ddp_train_step{run}"] == 20
    assert s[f"ddp_train_loss{run}"] == 2.25
    assert s[f"ddp_train_val_loss{run}"] == 2.75  # the last evaluation's, until the next
    assert s[f"ddp_train_tokens_per_second{run}"] == 13000.0
    assert s[f"ddp_train_mfu_ratio{run}"] == 0.42
    assert not [k for k in s if "lr" in k or "grad_norm" in k]
    assert sorted(p.name for p in prom.parent.iterdir()) == ["ddp_train.prom"]  # no temporary left
    assert oct(prom.stat().st_mode & 0o777) == "0o644"
    writer.close()
    assert (cfg.run_dir / "metrics.jsonl").read_text().count('"step": 20') == 1


def test_off_by_default_and_on_rank_0_only(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    assert cfg.log.prometheus is False
    _, writer = open_outputs(cfg, True, logging.getLogger("t"))
    assert isinstance(writer, JsonlWriter)
    prom = tmp_path / "ddp_train.prom"
    cfg = load_config(None, [f"run.dir={tmp_path}", "log.prometheus=true", f"log.prometheus_textfile={prom}"])
    _, writer = open_outputs(cfg, False, logging.getLogger("t"))
    assert not isinstance(writer, PromTextfile) and not prom.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_directory_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=r"log\.prometheus_textfile.*cannot write"):
        PromTextfile(JsonlWriter(None), locked / "ddp_train.prom", "r")


def test_a_missing_directory_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        PromTextfile(JsonlWriter(None), tmp_path / "nowhere" / "ddp_train.prom", "r")
    assert "log.prometheus_textfile" in str(err.value) and "cannot write" in str(err.value)


def test_the_default_file_is_per_user_and_run_and_its_series_say_whose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users share the textfile directory (setgid + sticky): one cannot replace another's file, and two
    files holding the same series make node_exporter serve neither. The name comes from the process's
    uid, not from $USER."""
    monkeypatch.setenv("USER", "someone-else")
    monkeypatch.setenv("LOGNAME", "someone-else")
    me = pwd.getpwuid(os.geteuid()).pw_name
    default = load_config(None, []).log.prometheus_textfile
    assert default == "/var/lib/prometheus/node-exporter/ddp_train-{user}-{run}.prom"
    textfile = str(tmp_path / Path(default).name)
    for run in ("a", 'b "x"/y'):
        PromTextfile(JsonlWriter(None), Path(textfile), run).write({"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"ddp_train-{me}-a.prom",
        f"ddp_train-{me}-b__x__y.prom",
    ]
    samples = _samples(tmp_path / f"ddp_train-{me}-b__x__y.prom")
    assert samples[f'ddp_train_step{{run="b \\"x\\"/y",user="{me}"}}'] == 1
    fixed = PromTextfile(JsonlWriter(None), tmp_path / "mine.prom", "a")  # no placeholder: as given
    assert fixed.path == tmp_path / "mine.prom"
