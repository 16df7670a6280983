"""GPU health before launch: the probe's collector over a fake nvidia-smi that replays recordings, and
the verdict (launch/preflight/gpuhealth.py) over them: one failure line per bad GPU, warnings for the rest."""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import pytest

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.node import probe
from ddp_train.launch.plan.inventory import Node, SshTarget, load_nodes
from ddp_train.launch.plan.plan import Options, build_plan
from ddp_train.launch.preflight import gpuhealth
from ddp_train.launch.preflight.preflight_model import NodeCheck

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
LOGS = FIXTURES / "logs"
BUS = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]  # the recording's GPUs 0..7


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake GPU node: a bin dir with the fakes first on PATH and a copy of the H100 x8 recordings."""
    bin_dir, rec = tmp_path / "bin", tmp_path / "rec"
    bin_dir.mkdir()
    shutil.copytree(FIXTURES / "h100x8", rec)
    (bin_dir / "nvidia-smi").symlink_to(FIXTURES / "fake" / "nvidia-smi")
    for name in ("dmesg", "journalctl", "dcgmi"):
        (bin_dir / name).symlink_to(FIXTURES / "fake" / "replay")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("DDP_FAKE_GPU_DIR", str(rec))
    return bin_dir, rec


def collect(bin_dir: Path, rec: Path, *flags: str, t0: float | None = None) -> dict:
    """Run the probe's collector (the `node` fixture put the fakes on PATH) and read its record back
    as preflight does."""
    raw = probe.collect_gpu("--gpu-health-dcgm" in flags, time.time() if t0 is None else t0)
    return gpuhealth.parse_probe_output("noise\n" + probe.GPU_MARK + json.dumps(raw) + "\n")


def edit(rec: Path, name: str, gpu: int, **values: str) -> None:
    """Change one GPU's row of a CSV recording (field names with '.' written as '__')."""
    path = rec / name
    rows = list(csv.reader(path.read_text().splitlines(), skipinitialspace=True))
    for field, value in values.items():
        rows[gpu + 1][rows[0].index(field.replace("__", "."))] = value
    path.write_text("\n".join(", ".join(r) for r in rows) + "\n")


def verdict(node, *flags: str, **kw) -> gpuhealth.Health:
    return gpuhealth.judge(collect(*node, *flags), **kw)


def test_healthy_h100x8_passes_with_nothing_to_say(node):
    h = verdict(node)
    assert (h.failures, h.warnings) == ([], [])
    assert [g.index for g in h.gpus] == [str(i) for i in range(8)]
    assert [g.bus_id for g in h.gpus] == [f"00000000:{b}:00.0" for b in BUS]
    assert (h.driver, h.fabric, h.xids, h.checked) == ("570.172.08", "ok", 0, True)


def test_the_probe_carries_the_collector_and_its_flags(node, monkeypatch, capsys):
    monkeypatch.setattr(probe, "collect_torch", dict)  # no torch import: the GPU part is under test
    assert probe.main(["venv", "workdir"]) == 0
    raw = gpuhealth.parse_probe_output(capsys.readouterr().out)
    assert raw is not None and raw["query"][0] == 0
    assert gpuhealth.probe_args("strict", False) == []
    assert gpuhealth.probe_args("warn", True) == ["--gpu-health-dcgm"]
    assert gpuhealth.probe_args("off", True) == ["--gpu-health-off"]


def test_off_collects_nothing(node, monkeypatch, capsys):
    monkeypatch.setattr(probe, "collect_torch", dict)
    assert probe.main(["v", "w", "--gpu-health-off"]) == 0
    out = capsys.readouterr().out
    assert probe.PROBE_MARK in out and gpuhealth.parse_probe_output(out) is None


def test_uncorrectable_ecc_fails_one_line_naming_the_gpu_and_the_reset(node):
    edit(node[1], "query-gpu.csv", 3, ecc__errors__uncorrected__volatile__total="2")
    h = verdict(node)
    assert h.failures == [
        "GPU 3 (00000000:5D:00.0): 2 uncorrectable ECC error(s) since the driver loaded; "
        "fix: reset the GPU (nvidia-smi -r -i 3) or reboot the node"
    ]
    assert h.warnings == []


def test_pending_page_retirement_fails(node):
    edit(node[1], "query-gpu.csv", 1, retired_pages__pending="Yes")  # pre-Ampere GPUs report Yes/No
    (h,) = [verdict(node)]
    assert len(h.failures) == 1 and h.failures[0].startswith("GPU 1 (00000000:2A:00.0): a page retirement")


def test_row_remap_failure_asks_for_a_replacement_and_pending_for_a_reset(node):
    edit(node[1], "remapped-rows.csv", 6, remapped_rows__failure="Yes", remapped_rows__uncorrectable="512")
    edit(node[1], "remapped-rows.csv", 2, remapped_rows__pending="Yes")
    h = verdict(node)
    assert h.failures == [
        "GPU 2 (00000000:3A:00.0): a row remap is pending; fix: reset the GPU (nvidia-smi -r -i 2) or reboot "
        "the node",
        "GPU 6 (00000000:BA:00.0): row remapping failed (no spare rows left); fix: drain the node and "
        "replace the GPU (RMA)",
    ]


def test_several_problems_of_one_gpu_make_one_line_with_each_remedy_once(node):
    edit(node[1], "query-gpu.csv", 5, ecc__errors__uncorrected__volatile__total="1")
    edit(node[1], "remapped-rows.csv", 5, remapped_rows__pending="Yes")
    (line,) = verdict(node).failures
    assert line.count("GPU 5 (") == 1 and line.count("nvidia-smi -r -i 5") == 1
    assert "uncorrectable ECC" in line and "row remap is pending" in line


def test_mig_on_fails_when_the_job_uses_whole_gpus_and_warns_otherwise(node):
    edit(node[1], "query-gpu.csv", 0, mig__mode__current="Enabled")
    (fail,) = verdict(node).failures
    assert fail.startswith("GPU 0 (00000000:18:00.0): MIG mode is on") and "nvidia-smi -i 0 -mig 0" in fail
    h = verdict(node, whole_gpus=False)
    assert h.failures == [] and h.warnings == ["GPU 0 (00000000:18:00.0): MIG mode is on"]


def test_persistence_off_is_a_warning_per_gpu(node):
    for i in range(8):
        edit(node[1], "query-gpu.csv", i, persistence_mode="Disabled")
    h = verdict(node)
    assert h.failures == [] and len(h.warnings) == 8
    assert h.warnings[7].startswith("GPU 7 (00000000:DB:00.0): persistence mode is off")
    assert "nvidia-persistenced" in h.warnings[7]


@pytest.mark.parametrize("state,status", [("In Progress", "N/A"), ("Not Started", "N/A")])
def test_fabric_manager_not_done_on_nvswitch_fails_every_gpu(node, state, status):
    q = node[1] / "q.txt"
    text = q.read_text().replace("State                             : Completed", f"State : {state}")
    q.write_text(text.replace("Status                            : Success", f"Status : {status}"))
    h = verdict(node)
    assert len(h.failures) == 8 and h.fabric == "not ready"
    assert h.failures[4].startswith(f"GPU 4 (00000000:9A:00.0): NVSwitch fabric state is '{state}'")
    assert "nvidia-fabricmanager" in h.failures[4]


def test_fabric_na_without_nvswitches_is_fine(node):
    q = node[1] / "q.txt"
    q.write_text(q.read_text().replace(": Completed", ": N/A").replace(": Success", ": N/A"))
    h = verdict(node)
    assert (h.failures, h.fabric) == ([], None)


def test_fabric_parser_reads_only_the_fabric_section():
    text = (FIXTURES / "h100x8" / "q.txt").read_text()  # also has "Conf Compute ... State : Disabled"
    states = gpuhealth.parse_fabric(text)
    assert len(states) == 8 and set(states.values()) == {("Completed", "Success")}


def test_xid_lines_fatal_ones_fail_the_gpu_others_warn(node):
    shutil.copy(LOGS / "dmesg-xid.txt", node[1] / "dmesg.txt")
    h = verdict(node)
    assert h.xids == 5
    assert h.failures == [
        "GPU 4 (00000000:9A:00.0): Xid 48 double-bit ECC error in the kernel log since boot; fix: reset the "
        "GPU (nvidia-smi -r -i 4) or reboot the node; the kernel log keeps the line until reboot "
        "(ddp_gpu_health: warn to launch anyway)",
        "GPU 7 (00000000:DB:00.0): Xid 79 GPU has fallen off the bus in the kernel log since boot; fix: "
        "reboot the node (check power, cooling and seating first); the kernel log keeps the line until "
        "reboot (ddp_gpu_health: warn to launch anyway)",
    ]
    assert h.warnings == [
        "GPU 0 (00000000:18:00.0): Xid 13 graphics engine exception in the kernel log since boot",
        "GPU 3 (00000000:5D:00.0): Xid 94 contained ECC error x2 in the kernel log since boot",
    ]


def test_fallen_off_the_bus_without_an_xid_names_the_missing_gpu():
    lines = (LOGS / "dmesg-offbus-no-xid.txt").read_text().splitlines()
    assert [(k, x) for k, x, _ in gpuhealth.parse_xids(lines)] == [((0, 0xB3, 0), 79)]
    xid79 = "NVRM: Xid (PCI:0000:b3:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    assert len(gpuhealth.parse_xids([xid79, *lines])) == 1  # the same event, counted once


def test_a_gpu_missing_from_nvidia_smi_but_in_the_xid_log_is_named_by_bus(node):
    shutil.copy(LOGS / "dmesg-offbus-no-xid.txt", node[1] / "dmesg.txt")
    (line,) = verdict(node).failures
    assert line.startswith("GPU ? (00000000:B3:00.0): Xid 79")


def test_nvidia_smi_without_the_driver_fails_the_node_in_one_line(node):
    shutil.copy(LOGS / "nvidia-smi-no-driver.txt", node[1] / "fail.txt")
    h = verdict(node)
    assert h.failures == [
        "nvidia-smi cannot talk to the NVIDIA driver (the kernel module is not loaded): load it "
        "(modprobe nvidia) or reboot into the installed driver (role nvidia_driver)"
    ]


def test_one_unreadable_gpu_fails_the_node_and_the_others_are_still_judged(node):
    raw = collect(*node)
    rows = raw["query"][1].splitlines()
    rows[7] = "Unable to determine the device handle for GPU0000:DB:00.0: Unknown Error"
    rows[2] = rows[2].replace(", Disabled, 0, ", ", Enabled, 0, ")  # GPU 2: MIG on
    raw["query"] = [15, "\n".join(rows), raw["query"][2]]
    h = gpuhealth.judge(raw)
    assert h.failures == [
        "nvidia-smi failed (exit 15): Unable to determine the device handle for GPU0000:DB:00.0: "
        "Unknown Error",
        "GPU 2 (00000000:3A:00.0): MIG mode is on but the job uses whole GPUs (NCCL does not run across MIG "
        "instances); fix: nvidia-smi -i 2 -mig 0, then reset the GPU",
    ]
    assert len(h.gpus) == 7


def test_kernel_log_denied_falls_back_to_journalctl_then_warns(node):
    rec = node[1]
    shutil.copy(LOGS / "dmesg-denied.txt", rec / "dmesg.txt")
    (rec / "dmesg.rc").write_text("1\n")
    shutil.copy(LOGS / "dmesg-xid.txt", rec / "journalctl.txt")
    raw = collect(*node)
    assert raw["kernel_log"]["source"] == "journalctl -k -b -q --no-pager"
    assert len(gpuhealth.judge(raw).failures) == 2
    (rec / "journalctl.txt").write_text("No journal files were opened due to insufficient permissions.\n")
    h = verdict(node)
    assert h.failures == []
    assert h.warnings == [
        "cannot read the kernel log (dmesg: dmesg: read kernel buffer failed: Operation not permitted; "
        "journalctl -k -b -q --no-pager: No journal files were opened due to insufficient permissions.): "
        "Xid errors not checked; run as root or add the user to the adm/systemd-journal group"
    ]


def test_an_older_nvidia_smi_without_a_field_still_answers(node):
    rec = node[1] / "query-gpu.csv"
    rows = [r.split(", ") for r in rec.read_text().splitlines()]
    drop = rows[0].index("retired_pages.pending")
    rec.write_text("\n".join(", ".join(c for i, c in enumerate(r) if i != drop) for r in rows) + "\n")
    raw = collect(*node)
    assert "retired_pages.pending" not in raw["query"][2] and raw["query"][0] == 0
    assert gpuhealth.judge(raw).failures == []


def test_gpu_requires_reset_in_place_of_a_value_fails(node):
    edit(node[1], "query-gpu.csv", 2, ecc__errors__uncorrected__volatile__total="[GPU requires reset]")
    (line,) = verdict(node).failures
    assert line.startswith("GPU 2 (00000000:3A:00.0): ecc.errors.uncorrected.volatile.total reads [GPU")


def test_dcgm_opt_in_pass_fail_and_missing(node):
    rec = node[1]
    shutil.copy(LOGS / "dcgmi-diag-r1-pass.txt", rec / "dcgmi.txt")
    assert (verdict(node, "--gpu-health-dcgm").failures, verdict(node).failures) == ([], [])
    assert "dcgm" not in collect(*node)  # not opted in: not run
    shutil.copy(LOGS / "dcgmi-diag-r1-fail.txt", rec / "dcgmi.txt")
    (rec / "dcgmi.rc").write_text("226\n")
    assert verdict(node, "--gpu-health-dcgm").failures == [
        "dcgmi diag -r 1 failed: Page Retirement/Row Remap (GPU 3 has pending row remaps. Reset the GPU.)"
    ]
    shutil.copy(LOGS / "dcgmi-no-hostengine.txt", rec / "dcgmi.txt")
    (h,) = [verdict(node, "--gpu-health-dcgm")]
    assert h.failures == [] and "nv-hostengine" in h.warnings[0]
    (node[0] / "dcgmi").unlink()
    assert "not installed" in verdict(node, "--gpu-health-dcgm").warnings[0]


def test_a_node_without_nvidia_gpus_is_not_checked(tmp_path):
    raw = collect(tmp_path, tmp_path)  # no nvidia-smi on PATH, no /proc/driver/nvidia here
    assert raw == {"driver": False, "smi": None}
    h = gpuhealth.judge(raw)
    assert (h.failures, h.warnings, h.checked) == ([], [], False)
    assert "nvidia-smi not found" in gpuhealth.judge(raw, torch_gpus=8).warnings[0]


def test_a_collector_crash_is_a_warning_not_a_traceback():
    h = gpuhealth.judge(gpuhealth.parse_probe_output('DDP-GPU {"error": "OSError: boom"}'))
    assert h.warnings == ["GPU health not checked: the probe's collector failed: OSError: boom"]
    assert gpuhealth.parse_probe_output("DDP-GPU {not json")["error"]
    assert json.dumps(gpuhealth.parse_probe_output("nothing")) == "null"


def test_inventory_vars(tmp_path: Path):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  hosts:\n    a: {}\n    b: {ddp_gpu_health: warn, ddp_gpu_health_dcgm: true}\n"
        "    c: {ddp_gpu_health: off}\n"  # YAML 1.1: unquoted off is false
    )
    got = [(n.gpu_health, n.gpu_health_dcgm) for n in load_nodes([str(inv)])]
    assert got == [("strict", False), ("warn", True), ("off", False)]
    for bad, message in (
        ("ddp_gpu_health: loud", "is not one of strict"),
        ("ddp_gpu_health_dcgm: 2", "true or"),
    ):
        inv.write_text(f"all:\n  hosts:\n    a: {{{bad}}}\n")
        with pytest.raises(LaunchError, match=f"host a: {bad.split(':')[0]}: .*{message}"):
            load_nodes([str(inv)])


def test_nvswitches_before_hopper_need_an_active_fabric_manager(node):
    q = node[1] / "q.txt"
    q.write_text(
        q.read_text().replace(": Completed", ": N/A").replace(": Success", ": N/A")
    )  # A100: no state
    raw = {**collect(*node), "nvswitches": 6, "fm_service": [3, "inactive\n"]}
    h = gpuhealth.judge(raw)
    assert h.failures == [
        "6 NVSwitches but nvidia-fabricmanager is inactive: systemctl enable --now nvidia-fabricmanager "
        "(its version must equal the driver's)"
    ]
    assert gpuhealth.judge({**raw, "fm_service": [0, "active\n"]}).failures == []


@pytest.mark.parametrize(
    "mode,nproc,fails,status",
    [("strict", "8", 1, "FAIL (1)"), ("warn", "8", 0, "warn (1)"), ("strict", "cpu", 0, "warn (1)")],
)
def test_check_and_doctor_row_follow_ddp_gpu_health_and_the_job(node, mode, nproc, fails, status):
    edit(node[1], "query-gpu.csv", 3, ecc__errors__uncorrected__volatile__total="2")
    n1 = Node(name="n1", address="10.0.0.1", local=False, ssh=SshTarget(host="10.0.0.1"), venv="/v",
              workdir=None, nproc=nproc, master_port=29500, env={}, gpu_health=mode)  # fmt: skip
    (plan,) = build_plan([n1], Options(job_id="j")).nodes
    c = NodeCheck(plan, facts={"gpus": 0, "gpu_health": collect(*node)})
    gpuhealth.check(c)
    assert (len(c.failures), len(c.warnings)) == (fails, 1 - fails)
    assert gpuhealth.render([c]).splitlines()[1].split()[-2:] == status.split()
    cpu_node = NodeCheck(plan, facts={"gpus": 0, "gpu_health": {"driver": False, "smi": None}})
    assert gpuhealth.render([cpu_node]) is None


def test_a_hung_nvidia_smi_gets_what_is_left_of_the_probes_time(node, tmp_path):
    """The budget counts from the probe's start (main's t0, before the torch import), not from the
    collector's: with 87 of its 90 s gone, a hanging nvidia-smi is killed after ~3 s and the probe's
    other lines still get out well inside the SSH call's 120 s."""
    bin_dir, rec = node
    (bin_dir / "nvidia-smi").unlink()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 600\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    t0 = time.monotonic()
    raw = collect(bin_dir, rec, t0=time.time() - 87)
    took = time.monotonic() - t0
    assert raw["query"][0] == 124 and "timed out" in raw["query"][1]
    assert took < 12, took  # from its own start it would have waited 20 s (the per-command limit)


def test_doctor_shows_what_already_runs_on_the_gpus_and_dashes_where_nvidia_smi_has_no_use_fields(node):
    """On a shared cluster the first question before a launch: is another job on these GPUs?"""
    n1 = Node(name="n1", address="10.0.0.1", local=False, ssh=SshTarget(host="10.0.0.1"), venv="/v",
              workdir=None, nproc="8", master_port=29500, env={}, gpu_health="strict")  # fmt: skip
    (plan,) = build_plan([n1], Options(job_id="j")).nodes

    def row() -> list[str]:
        c = NodeCheck(plan, facts={"gpus": 8, "gpu_health": collect(*node)})
        gpuhealth.check(c)
        header, line = gpuhealth.render([c]).splitlines()[:2]
        assert header.split()[-5:] == ["UTIL", "MEAN/MIN", "MEM", "USED", "GPU_HEALTH"]
        return line.split()

    assert row()[-5:] == ["0/0", "%", "0.0/637", "GiB", "ok"]  # idle: 1 MiB used of 81559 on each
    for gpu in range(8):  # someone else's job: 97 % on seven GPUs, 20 % on one, 61 GiB each
        edit(node[1], "query-gpu.csv", gpu, utilization__gpu="20" if gpu == 5 else "97", memory__used="62464")
    assert row()[-5:] == ["87/20", "%", "488.0/637", "GiB", "ok"]
    rec = node[1] / "query-gpu.csv"  # an nvidia-smi that knows neither field (or reads [N/A])
    rows = [r.split(", ") for r in rec.read_text().splitlines()]
    drop = {rows[0].index("utilization.gpu"), rows[0].index("memory.used")}
    rec.write_text("\n".join(", ".join(c for i, c in enumerate(r) if i not in drop) for r in rows) + "\n")
    assert row()[-3:] == ["-", "-", "ok"]
