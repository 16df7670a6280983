"""ddp_on_node_loss: restart, in pure parts: the policy from the inventory and the command line, the next
attempt's plan (`replan`), whether an attempt's end restarts the job (`nodeloss.decide`), the lost node
an attempt's end names (`report.lost`), what `status` shows of the attempts, and the metrics kept across
them."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

import pytest

from ddp_train import exitcodes
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.jobs.jobcmds import recovery_lines
from ddp_train.launch.jobs.metricsview import merged
from ddp_train.launch.plan.plan import FRESH, KEEP_GLOBAL_BATCH, Options, Recovery, build_plan, replan
from ddp_train.launch.run.logs import JobLog
from ddp_train.launch.run.nodeloss import decide
from ddp_train.launch.run.noderun import NodeRun, NodeState
from ddp_train.launch.run.report import Ending, JobResult, Loss, lost
from ddp_train.launch.run.trainerlog import Step, StepTimes
from ddp_train.launch.run.watchdog import STALL_FLOOR_S, StallWatch
from tests.unit.test_launch_plan import cluster, node


def result(code: int, *losses: Loss) -> JobResult:
    return JobResult(code, "first failure: ...", False, losses[0].host if losses else None, {}, 12.0, losses)


def crash(host: str, code: int | None = None) -> Loss:
    return Loss(host, "ssh connection lost", time.time(), code)


RESTART = Recovery("restart", max_losses=2, min_nodes=2)
NODES = ["n0", "n1", "n2", "n3"]


def test_a_lost_node_restarts_the_job_on_the_others_and_says_so() -> None:
    d = decide(result(exitcodes.NODE_FAILED, crash("n0")), RESTART, [], NODES, attempt=1)
    assert d.restart and d.exclude == ("n0",)
    assert d.lines == (
        "n0 lost (ssh connection lost); excluded; restarting on 3 node(s) as attempt 2 of the job (1 of "
        "ddp_max_node_losses 2 used)",
    )


def test_nothing_restarts_by_default_nor_after_success_a_stop_or_a_timeout() -> None:
    assert not decide(result(exitcodes.NODE_FAILED, crash("n0")), Recovery(), [], NODES, 1).restart
    for code in (exitcodes.OK, exitcodes.SIGTERM, exitcodes.SIGINT, exitcodes.TIMEOUT):
        d = decide(result(code, crash("n0")), RESTART, [], NODES, 1)
        assert not d.restart and d.lines == (), code


def test_a_node_whose_ranks_refused_the_config_is_no_loss_every_node_would_repeat_it() -> None:
    d = decide(result(exitcodes.NODE_FAILED, crash("n1", code=2)), RESTART, [], NODES, 1)
    assert not d.restart
    assert d.lines[0].startswith("not restarting: n1's ranks ended with exit 2 (ssh connection lost)")


def test_it_gives_up_with_one_line_per_lost_node_once_the_losses_are_used_up() -> None:
    before = [{"host": "n0", "reason": "ssh connection lost", "at": 0, "attempt": 1},
              {"host": "n2", "reason": "exited 1: boom", "at": 0, "attempt": 2}]  # fmt: skip
    d = decide(result(exitcodes.NODE_FAILED, crash("n3")), RESTART, before, ["n1", "n3"], attempt=3)
    assert not d.restart
    assert [x.split(" at ")[0] for x in d.lines[:3]] == ["lost n0", "lost n2", "lost n3"]
    assert d.lines[1].endswith("(attempt 2): exited 1: boom")
    assert d.lines[-1] == "giving up: 3 node(s) lost, more than ddp_max_node_losses 2"


def test_it_gives_up_rather_than_go_on_with_fewer_than_min_nodes() -> None:
    d = decide(result(exitcodes.STALLED, crash("n1")), RESTART, [], ["n0", "n1"], 1)
    assert not d.restart and d.lines[-1] == "giving up: 1 node(s) left, fewer than ddp_min_nodes 2"


def test_the_policy_comes_from_the_inventory_and_the_command_line_wins() -> None:
    nodes = cluster(on_node_loss="restart", max_node_losses=1)
    assert build_plan(nodes, Options(job_id="j")).recovery == Recovery("restart", 1, 2)
    plan = build_plan(nodes, Options(job_id="j", on_node_loss="stop", max_node_losses=0, min_nodes=3))
    assert plan.recovery == Recovery("stop", 0, 3)
    with pytest.raises(LaunchError, match=r"ddp_min_nodes \(or --min-nodes\) 4: from 1 to the job's 3"):
        build_plan(nodes, Options(job_id="j", min_nodes=4))
    with pytest.raises(LaunchError, match="ddp_on_node_loss must be the same on every node"):
        build_plan([*cluster()[:2], node("n2", "10.0.0.3", on_node_loss="restart")], Options(job_id="j"))


def test_the_next_attempt_moves_the_master_resumes_and_keeps_the_global_batch() -> None:
    opts = Options(job_id="j", overrides=("train.max_steps=40", FRESH), config="cfg.yaml", max_restarts=None)
    plan = build_plan(cluster(on_node_loss="restart"), opts)
    nxt = replan(plan, ["n0"], "/monitor/jobs/j/cfg.yaml")
    assert nxt.job_id == "j" and [(p.node.name, p.rank) for p in nxt.nodes] == [("n1", 0), ("n2", 1)]
    assert nxt.master_name == "n1" and nxt.master_addr == "10.0.0.2" and nxt.recovery == plan.recovery
    argv = nxt.nodes[1].argv
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--master-addr") + 1] == "10.0.0.2"
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets == ["train.max_steps=40", KEEP_GLOBAL_BATCH]  # --fresh dropped: the next attempt resumes
    assert nxt.nodes[1].config_path == ".ddp-launch/j/cfg.yaml" and nxt.sync is None
    again = replan(nxt, ["n2"], None)
    assert [p.node.name for p in again.nodes] == ["n1"] and again.options.attempt == 3


def test_a_users_global_batch_and_script_are_left_as_they_are() -> None:
    plan = build_plan(cluster(), Options(job_id="j", overrides=("train.global_batch=96",)))
    argv = replan(plan, ["n2"], None).nodes[0].argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] == ["train.global_batch=96"]
    script = build_plan(cluster(), Options(job_id="j", script="train.py", script_args=("--lr", "1")))
    assert replan(script, ["n1"], None).nodes[1].argv[-3:] == ("train.py", "--lr", "1")


def test_c10d_attempts_get_a_rendezvous_of_their_own() -> None:
    plan = build_plan(cluster(), Options(job_id="j", max_restarts=1))
    ids = [(p.argv[p.argv.index("--rdzv-id") + 1]) for p in replan(plan, ["n1"], None).nodes]
    assert ids == ["j.a2", "j.a2"] and plan.nodes[0].argv[plan.nodes[0].argv.index("--rdzv-id") + 1] == "j"


def test_a_master_address_pinned_to_the_lost_master_is_one_line_not_a_hang() -> None:
    plan = build_plan(cluster(master_addr="10.0.0.1"), Options(job_id="j"))
    with pytest.raises(LaunchError, match=r"ddp_master_addr 10.0.0.1 is the address of n0, the lost master"):
        replan(plan, ["n0"], None)
    assert replan(plan, ["n2"], None).master_addr == "10.0.0.1"  # a lost worker: the master stays
    pinned = build_plan(cluster(master="n0"), Options(job_id="j"))
    with pytest.raises(LaunchError, match=r"ddp_master 'n0' is not one of the selected nodes"):
        replan(pinned, ["n0"], None)


def test_an_attempts_end_names_its_root_cause_or_the_nodes_it_could_not_reach(tmp_path: Path) -> None:
    plan = build_plan(cluster(), Options(job_id="j"))
    log = JobLog(tmp_path, "j")
    runs = [NodeRun(p) for p in plan.nodes]
    runs[1].state, runs[1].detail, runs[1].ended = NodeState.LOST, "ssh connection lost", time.monotonic() - 5
    end = Ending(exitcodes.NODE_FAILED, "first failure: n1 ...", cause=runs[1])
    (found,) = lost(runs, end, log)
    assert (found.host, found.reason, found.code) == ("n1", "ssh connection lost", None)
    assert abs(time.time() - 5 - found.at) < 1
    stall = Ending(exitcodes.STALLED, "no progress", cause=runs[2], stalled=True)
    assert [(x.host, x.reason) for x in lost(runs, stall, log)] == [
        ("n2", "stalled: the stall watchdog named it")
    ]
    runs[0].fail("cannot connect to 10.0.0.1:22: timed out")
    unreached = Ending(exitcodes.NODE_FAILED, "could not connect to every node; nothing was started")
    assert [x.host for x in lost(runs, unreached, log)] == ["n0"]
    assert lost(runs, dataclasses.replace(end, code=exitcodes.SIGTERM), log) == ()
    log.close()


def test_status_shows_the_attempts_the_lost_nodes_and_what_each_loss_cost() -> None:
    t = 1_800_000_000.0
    data = {
        "job_id": "j", "policy": {"mode": "restart", "max_losses": 2, "min_nodes": 2},
        "nodes": [{"host": "n1"}, {"host": "n3"}],
        "attempts": [
            {"n": 1, "nodes": ["n0", "n1", "n2", "n3"], "master": "n0", "resumed_step": None, "last_step": 13,
             "exit_code": 1, "reason": "first failure: n0 (rank 0) ssh connection lost"},
            {"n": 2, "nodes": ["n1", "n2", "n3"], "master": "n1", "resumed_step": 10, "last_step": 27,
             "first_step_at": t + 31, "exit_code": 1, "reason": "first failure: n2 (rank 1) ssh lost"},
            {"n": 3, "nodes": ["n1", "n3"], "master": "n1", "resumed_step": 20, "last_step": 40,
             "first_step_at": t + 100, "exit_code": 0, "reason": "every node finished"},
        ],
        "lost": [{"host": "n0", "reason": "ssh connection lost", "at": t, "attempt": 1},
                 {"host": "n2", "reason": "ssh connection lost: no reply to SSH heartbeats for 10s",
                  "at": t + 60, "attempt": 2}],
    }  # fmt: skip
    lines = recovery_lines(data)
    assert lines[0] == (
        "attempt 1: 4 nodes (n0, n1, n2, n3), master n0, steps 0-13, exit 1: first failure: n0 (rank 0) ssh "
        "connection lost"
    )
    assert lines[2].startswith("attempt 3: 2 nodes (n1, n3), master n1, steps 20-40, exit 0")
    assert lines[3].startswith("lost n0 at ") and lines[3].endswith(
        "(attempt 1): ssh connection lost; steps lost: 3; training went on 31s later"
    )
    assert lines[4].endswith("steps lost: 7; training went on 40s later")
    assert lines[5].startswith(
        "2 of ddp_max_node_losses 2 used; now on 2 node(s); a lost node is not re-added"
    )
    assert recovery_lines({"job_id": "j", "attempts": [data["attempts"][0]], "lost": []}) == []


def test_after_a_lost_master_the_metrics_keep_the_earlier_attempts_records_in_front() -> None:
    rec = lambda s: json.dumps({"step": s, "loss": 1.0 / s}).encode() + b"\n"  # noqa: E731
    earlier = rec(1) + rec(2) + rec(3) + b'{"step": 4, "los'  # attempt 1's copy, cut mid-line
    own_disk = rec(3) + rec(4)  # the new rank 0 resumed from step 2: its file starts at step 3
    assert merged(earlier, own_disk) == rec(1) + rec(2) + rec(3) + rec(4)
    shared = rec(1) + rec(2) + rec(3) + rec(4)  # a shared run dir: the file holds every step
    assert merged(earlier, shared) == shared
    assert merged(earlier, b"") == earlier and merged(b"", own_disk) == own_disk


def test_a_stop_even_during_the_teardown_or_processes_left_on_a_staying_node_restart_nothing() -> None:
    stopped = dataclasses.replace(result(exitcodes.NODE_FAILED, crash("n0")), signal=signal.SIGTERM)
    d = decide(stopped, RESTART, [], NODES, 1)
    assert not d.restart and d.lines == ("not restarting: stopped by SIGTERM",)
    leftovers = {"n0": ["unknown: cannot connect"], "n2": ["4242 python"]}
    left = dataclasses.replace(result(exitcodes.NODE_FAILED, crash("n0")), leftovers=leftovers)
    d = decide(left, RESTART, [], NODES, 1)
    assert not d.restart and d.lines[-1].startswith("not restarting: processes of the job remain on n2 ")
    only_lost = dataclasses.replace(left, leftovers={"n0": ["unknown: cannot connect"]})
    assert decide(only_lost, RESTART, [], NODES, 1).restart  # the lost node's own: it is left out


def test_after_the_last_step_a_short_stall_timeout_waits_for_the_final_save_and_exit(tmp_path: Path) -> None:
    watch = StallWatch("j", tmp_path, 15.0, StepTimes())
    watch.feed(Step(0, 29, 30, 1.0, 100.0, 0.1))
    assert watch.timeout() == 15.0
    watch.feed(Step(0, 30, 30, 1.0, 100.0, 0.1))  # the last step: the final save, check and exit follow
    assert watch.timeout() == STALL_FLOOR_S


def test_a_node_that_fails_the_restarts_preflight_is_left_out_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: "a failed health check at restart" is a lost node. n0 crashes; attempt 2's preflight
    fails on n2 (say a GPU that fell off the bus), so attempt 2 runs on n1 and n3 alone, and the second
    loss uses up ddp_max_node_losses. With the losses used up, a failing preflight ends the job there."""
    from ddp_train.launch import pipeline
    from ddp_train.launch.jobs import jobstate, metricsview

    monkeypatch.setattr(metricsview, "start", lambda *a: None)
    nodes = [node(f"n{i}", f"10.0.0.{i + 1}") for i in range(4)]
    plan = build_plan(nodes, Options(job_id="pf", on_node_loss="restart", max_node_losses=2, min_nodes=2))

    class Backend(pipeline.SshBackend):
        def __init__(self, refusals: list[dict[str, str]], results: list[JobResult]) -> None:
            super().__init__(pipeline.LaunchConfig(plan, []), JobLog(tmp_path, "pf"))
            self.refusals, self.results, self.prepared_on, self.ran_on = refusals, results, [], []

        def prepare(self, p, on_plan):  # type: ignore[no-untyped-def]
            self.prepared_on.append([x.node.name for x in p.nodes])
            failed = self.refusals.pop(0) if self.prepared_on[1:] and self.refusals else {}
            if failed:
                raise pipeline.Refused(exitcodes.PREFLIGHT, failed)
            return p

        def run(self, p, on_state):  # type: ignore[no-untyped-def]
            self.ran_on.append([x.node.name for x in p.nodes])
            return self.results.pop(0)

    state = tmp_path / "pf" / jobstate.STATE_FILE
    jobstate.write_state(state, {"job_id": "pf"})
    b = Backend([{"n2": "8 GPUs expected, 7 found"}], [result(exitcodes.NODE_FAILED, crash("n0")), result(0)])
    assert pipeline._attempts(b.cfg, plan, b, b.log, state) == 0
    assert b.prepared_on == [NODES, ["n1", "n2", "n3"], ["n1", "n3"]] and b.ran_on == [NODES, ["n1", "n3"]]
    data = jobstate.read_state(state)
    assert [(x["host"], x["attempt"]) for x in data["lost"]] == [("n0", 1), ("n2", 1)]
    assert data["lost"][1]["reason"] == "failed the preflight of attempt 2: 8 GPUs expected, 7 found"
    b.log.close()
    said = (tmp_path / "pf" / "launcher.log").read_text()
    assert (
        "n2 lost (failed the preflight of attempt 2: 8 GPUs expected, 7 found); excluded; restarting on 2 "
        "node(s) as attempt 2 of the job (2 of ddp_max_node_losses 2 used)" in said
    ), said
    # the losses used up: a third failing node ends the job with exit 3 and every lost node named
    b = Backend([{"n2": "no GPU"}, {"n3": "no GPU"}], [result(exitcodes.NODE_FAILED, crash("n0"))])
    assert pipeline._attempts(b.cfg, plan, b, b.log, state) == exitcodes.PREFLIGHT
    assert b.prepared_on == [NODES, ["n1", "n2", "n3"], ["n1", "n3"]] and b.ran_on == [NODES]
    data = jobstate.read_state(state)
    assert "attempt 2 refused before it started" in data["reason"]
    b.log.close()
    said = (tmp_path / "pf" / "launcher.log").read_text().split("giving up")[-2:]
    assert said[-1].startswith(": 3 node(s) lost, more than ddp_max_node_losses 2"), said


def test_a_node_the_others_cannot_reach_is_the_one_at_fault_not_they() -> None:
    """One node's training NIC broke while its SSH works: every other node's network probe fails to reach
    it and it fails to reach them. Only that node is lost at a restart; a node's own failure (its GPU)
    always counts; two nodes that cannot reach each other cannot be told apart: both are named."""
    from ddp_train.launch.preflight.preflight_model import NodeCheck, Report

    plan = build_plan([node(f"n{i}", f"10.0.0.{i + 1}") for i in range(4)], Options(job_id="r"))
    checks = [NodeCheck(p) for p in plan.nodes]
    for c in checks[:3]:
        c.fail_to_reach("n3", "cannot reach n3's ephemeral port 10.0.0.4:41000 (timed out)")
    for peer in ("n0", "n1", "n2"):
        checks[3].fail_to_reach(peer, f"cannot reach {peer}'s ephemeral port (timed out)")
    checks[1].fail("7 GPUs, 8 expected")
    assert Report(checks).at_fault() == {
        "n1": "7 GPUs, 8 expected",
        "n3": "cannot reach n0's ephemeral port (timed out)",
    }
    pair = [NodeCheck(p) for p in build_plan(cluster()[:2], Options(job_id="r")).nodes]
    pair[0].fail_to_reach("n1", "x")
    pair[1].fail_to_reach("n0", "y")
    said = "1 of the other 1 node(s) cannot reach it on the training network"
    assert Report(pair).at_fault() == {"n0": said, "n1": said}
