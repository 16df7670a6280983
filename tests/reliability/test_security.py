"""Security: hostile inventory values never reach a shell, host keys are always verified, secrets masked.

- Hostile host vars, env values, paths, host names, --set values and trainer arguments (`; rm -rf`,
  `$(...)`, backticks, quotes, newlines): each remote command is only shlex-quoted words around one
  `&&`, the words carry the values verbatim, and running the command (locally through /bin/sh, and
  for real on testbed hosts over SSH) creates no canary file while the trainer sees every value as is.
- An unknown or changed SSH host key stops the job before anything starts, with a line naming the
  host and the fix; known_hosts is never written.
- ddp_env values whose names contain TOKEN/KEY/SECRET/PASSWORD never appear in --dry-run output, on
  the console, or in any log file, even when the trainer itself prints them; and no ddp_env value is
  in the command line of any process on a node (the environment reaches the node's agent on stdin).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from ddp_train.launch.cli import main as launch_main
from ddp_train.launch.plan.plan import PGID_MARKER
from tests.cluster.test_launch_testbed import Launcher, assert_nothing_left, job_pids, launch
from tests.reliability.support import finals, job_id, local_inventory, proc_env, stop, worker_pid
from tests.testbed import Testbed
from tests.unit.test_launch_plan import fake_venv
from tests.unit.test_launch_security import as_user, unprivileged_user  # noqa: F401 - a fixture

SECRETS = {
    "HF_TOKEN": "hf_Zq81-token-value",
    "DB_PASSWORD": "pw-Zq81-password",
    "MY_API_KEY": "key-Zq81-api",
    "aws_secret_access_key": "aws-Zq81-secret",  # matching is case-insensitive
}


def hostile(canary: Path) -> str:
    """A value that runs `touch canary` in every way a shell could be tricked into running it."""
    c = shlex.quote(str(canary))
    return (
        f"$(touch {c}) `touch {c}`; touch {c} && touch {c} || touch {c} | touch {c} & "
        f"'; touch {c}; ' \"; touch {c}; \" \\ back\\slash\nnewline; rm -rf ~ # * ~ $HOME >x <y"
    )


# Path components cannot hold the canary's absolute path (it has slashes): they touch PWNED relative to
# whatever directory a shell would run them in (checked: the test dirs and the hosts' login dir).
PWNED = "pwned"
HOSTILE_NAME = f"$(touch {PWNED}) `touch {PWNED}`; touch {PWNED} 'q' \"dq\" & | > <"


def hostile_dir(root: Path) -> Path:
    """A real directory whose name is hostile too (no newline: inventories refuse those in paths)."""
    path = root / f"dir {HOSTILE_NAME}"
    path.mkdir(parents=True)
    return path


def assert_no_canary(canary: Path, *dirs: Path) -> None:
    assert not canary.exists()
    for d in dirs:
        assert not (d / PWNED).exists() and not (d / "x").exists(), d


def dry_run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    cut = argv.index("--") if "--" in argv else len(argv)
    try:
        code = launch_main([*argv[:cut], "--dry-run", *argv[cut:]])
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_commands_are_quoted_words_that_carry_hostile_values_verbatim(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    canary = tmp_path / "canary"
    value = hostile(canary)
    workdir = hostile_dir(tmp_path)
    venv = tmp_path / f"venv {HOSTILE_NAME}"
    venv.symlink_to(fake_venv(tmp_path))  # its torchrun prints argv, env and cwd as JSON
    names = ["local0", f"h1 {HOSTILE_NAME}"]
    inv = tmp_path / "inv.yml"
    inv.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {n: None for n in names},
                    "vars": {
                        "ansible_connection": "local",
                        "ansible_host": "127.0.0.1",
                        "ddp_workdir": str(workdir),
                        "ddp_venv": str(venv),
                        "ddp_env": {"HOSTILE": value, "EMPTY": "", **SECRETS},
                    },
                }
            }
        )
    )
    run_dir = "runs $(touch x) `y`; z"
    trainer_args = [value, "--", "'", '"', "$(touch x)"]
    monkeypatch.chdir(tmp_path)
    code, out, err = dry_run(
        ["--hosts", str(inv), "--job-id", "sec-dry", "--env", f"ALSO={value}", "--set", f"run.dir={run_dir}",
         "--", *trainer_args],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    # a command may span lines (an env value holds a newline), so split on the per-node headers
    assert out.count(f"cd -- {shlex.quote(str(workdir))} && exec setsid -w env ") == 2, out
    blocks = out.split("\n# [")[1:]
    assert len(blocks) == 2, out
    sent = {"HOSTILE": value, "ALSO": value, "EMPTY": "", **SECRETS}
    for rank, block in enumerate(blocks):
        _, env_comment, cmd = block.split("\n", 2)
        cmd = cmd.rstrip("\n")
        shown = json.loads(env_comment.split("# environment, sent on stdin: ", 1)[1])
        assert {k: shown[k] for k in sent} == {**sent, **dict.fromkeys(SECRETS, "***")}
        words = shlex.split(cmd)
        # shell operators only where the launcher put them: exactly one `&&`, nothing else unquoted
        lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        operators = [t for t in lexer if t and set(t) <= set("();<>|&")]
        assert operators == ["&&"], operators
        assert words[:8] == ["cd", "--", str(workdir), "&&", "exec", "setsid", "-w", "env"]
        assert words[8 : words.index("sh")] == ["DDP_JOB_ID=sec-dry"]  # no ddp_env value on the line
        agent = words[words.index("ddp-launch") + 1 :]
        assert agent[:3] == [f"{venv}/bin/python", "-m", "ddp_train.agent"]
        argv = agent[3:]
        assert argv[0] == f"{venv}/bin/torchrun"
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[-(len(trainer_args) + 2) :] == ["--set", f"run.dir={run_dir}", *trainer_args]
        # and a real shell runs it as those words: the fake torchrun reports what it received
        line = json.dumps(sent) + "\n"  # what the launcher writes to the command's stdin
        res = subprocess.run(["/bin/sh", "-c", cmd], input=line, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        marker, payload = res.stdout.split("\n", 1)
        assert marker.startswith(PGID_MARKER + " ")
        seen = json.loads(payload)
        # the agent puts torchrun's --log-dir first, in its private directory (ddp_train/agent.py)
        assert seen["argv"][2:] == argv[1:] and seen["cwd"] == str(workdir)
        assert seen["argv"][0] == "--log-dir" and Path(seen["argv"][1]).parent.name.startswith(
            "ddp-agent-sec-dry-"
        )
        assert seen["env"]["HOSTILE"] == value and seen["env"]["ALSO"] == value
    for secret in SECRETS.values():
        assert secret not in out + err
    assert_no_canary(canary, tmp_path, workdir)


def named_inventory(
    tb: Testbed, root: Path, hosts: dict[str, str], all_vars: dict, host_vars: dict | None = None
) -> Path:
    """An inventory of named testbed hosts (name -> IP) with the testbed's SSH settings."""
    base = yaml.safe_load(tb.inventory.read_text())["all"]["vars"]
    inv = {
        "all": {
            "children": {
                "gpu_nodes": {
                    "hosts": {
                        n: {"ansible_host": ip, **(host_vars or {}).get(n, {})} for n, ip in hosts.items()
                    }
                }
            },
            "vars": {**base, **all_vars},
        }
    }
    path = root / "inventory.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.testbed
def test_hostile_values_reach_the_trainer_on_testbed_hosts_verbatim(testbed: Testbed, tmp_path: Path) -> None:
    tb = testbed
    node0, node1 = tb.hosts()[:2]
    canary = tmp_path / "canary"
    value = hostile(canary)
    workdir = hostile_dir(tmp_path)
    venv = tmp_path / f"venv {HOSTILE_NAME}"
    venv.symlink_to(sys.prefix)
    probe = tmp_path / "probe"
    probe.mkdir()
    # In every trainer worker: record HOSTILE and the cwd as received, and print every secret in the clear.
    (probe / "sitecustomize.py").write_text(
        "import json, os, socket\n"
        "if 'LOCAL_RANK' in os.environ and 'HOSTILE' in os.environ:\n"
        f"    with open(os.path.join({str(probe)!r}, socket.gethostname() + '.json'), 'w') as f:\n"
        "        json.dump({'hostile': os.environ['HOSTILE'], 'cwd': os.getcwd()}, f)\n"
        f"    for k in {sorted(SECRETS)!r}:\n"
        "        print('leak', k, os.environ[k], flush=True)\n"
    )
    evil_name = f"../n1 {HOSTILE_NAME}"
    inv = named_inventory(
        tb, tmp_path, {"node0": node0.ip, evil_name: node1.ip},
        {"ddp_workdir": str(workdir), "ddp_venv": str(venv),
         "ddp_env": {"HOSTILE": value, "PYTHONPATH": str(probe), **SECRETS}},
    )  # fmt: skip
    job = job_id("sec-tb")
    run_dir = "runs $(touch x) `y`; z"
    code, out = launch(
        ["--hosts", str(inv), "--job-id", job, "--set", "train.max_steps=3", "--set", f"run.dir={run_dir}"],
        tmp_path, timeout=300,
    )  # fmt: skip
    assert code == 0, out
    assert len(finals(out.splitlines())) == 2, out
    for host in (node0, node1):
        seen = json.loads((probe / f"{host.name}.json").read_text())
        assert seen == {"hostile": value, "cwd": str(workdir)}, host.name
    assert (workdir / run_dir / "default" / "metrics.jsonl").exists()  # rank 0 wrote where it was told
    assert_no_canary(canary, tmp_path, workdir)
    for host in (node0, node1):  # a command that lost its quoting would run in the login directory
        tb.exec(host, f"cd && test ! -e {PWNED} && test ! -e x")  # raises if either exists
    # the secrets: printed by the trainer, masked by the launcher on the console and in every file
    logs = tmp_path / "logs" / job
    files = sorted(p for p in logs.rglob("*") if p.is_file())
    assert all(p.parent == logs for p in files), files  # the hostile host name stayed inside logs/<job>/
    assert [p.name for p in (tmp_path / "logs").iterdir()] == [job]
    everything = out.encode() + b"".join(p.read_bytes() for p in files)  # metrics.png is binary
    for name, secret in SECRETS.items():
        assert secret.encode() not in everything, name
        assert f"leak {name} ***" in out
        assert f'"{name}": "***"' in (logs / "launcher.log").read_text()  # the env shown: JSON, masked
    assert_nothing_left(tb, job)


@pytest.mark.slow
@pytest.mark.testbed
def test_unknown_or_changed_host_key_is_refused_before_anything_starts(
    testbed: Testbed, tmp_path: Path
) -> None:
    tb = testbed
    node0, node1, node2 = tb.hosts()[:3]
    keys = tb.state_dir / "hosts"
    key_of = {
        h.name: " ".join((keys / h.name / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        for h in tb.hosts()
    }
    unknown = tmp_path / "known_hosts_empty"
    unknown.write_text("")
    changed = tmp_path / "known_hosts_changed"
    changed.write_text(f"{node2.ip} {key_of['node0']}\n")  # node2's address, someone else's key
    before = {p: p.read_bytes() for p in (unknown, changed, tb.known_hosts)}
    inv = named_inventory(
        tb, tmp_path, {h.name: h.ip for h in (node0, node1, node2)},
        {"ddp_workdir": str(tmp_path), "ddp_venv": sys.prefix},
        host_vars={
            name: {"ansible_ssh_common_args": f"-o UserKnownHostsFile={path} -o StrictHostKeyChecking=yes"}
            for name, path in (("node1", unknown), ("node2", changed))
        },
    )  # fmt: skip
    home = tmp_path / "home"  # no ~/.ssh/known_hosts: only the inventory's files count
    home.mkdir()
    unknown_why = (
        f"host key unknown: {node1.ip} is not in {home}/.ssh/known_hosts, {unknown}; verify the host's key "
        f"out of band, then: ssh-keyscan -H {node1.ip} >> ~/.ssh/known_hosts "
        "(host key checking is never disabled)"
    )
    changed_why = "HOST KEY MISMATCH: the server offered ssh-ed25519 "
    changed_fix = (
        "(possible man-in-the-middle); if the host was reinstalled, verify its new key and replace the entry "
        f"(ssh-keygen -R {node2.ip})"
    )

    job = job_id("sec-key")
    code, out = launch(["--hosts", str(inv), "--job-id", job], tmp_path, home=home)
    assert code == 3, out  # preflight
    lines = out.splitlines()
    assert f"FAIL node1: ssh: {unknown_why}" in lines, out
    assert [
        ln for ln in lines if ln.startswith(f"FAIL node2: ssh: {changed_why}") and ln.endswith(changed_fix)
    ], out
    assert "nothing was started" in out

    job2 = job_id("sec-key-skip")
    code, out = launch(["--hosts", str(inv), "--job-id", job2, "--skip-preflight"], tmp_path, home=home)
    assert code == 1, out
    assert f"node1 (root@{node1.ip}:22): {unknown_why}" in out, out
    assert [
        ln
        for ln in out.splitlines()
        if f"node2 (root@{node2.ip}:22): {changed_why}" in ln and ln.endswith(changed_fix)
    ], out
    assert "could not connect to every node; nothing was started" in out
    assert not [ln for ln in out.splitlines() if ln.startswith("[node")], out  # no node printed a line
    for j in (job, job2):
        assert job_pids(j) == []
    assert {p: p.read_bytes() for p in before} == before  # nothing was added to any known_hosts
    assert not (home / ".ssh").exists()


@pytest.mark.slow
def test_secret_values_are_in_no_command_line_on_the_node(tmp_path: Path) -> None:
    """Formerly a strict xfail: `setsid -w env K=V ...` kept ddp_env values readable by every user."""
    secret = "hf_Zq81-visible-in-ps"
    inv = local_inventory(tmp_path, nodes=1, ddp_env={"HF_TOKEN": secret})
    job = job_id("sec-ps")
    run = Launcher(
        ["--hosts", str(inv), "--job-id", job, "--set", "train.max_steps=200",
         "--set", "debug.step_delay_s=0.2", "--set", "log.interval_steps=1", "--set", f"run.dir={tmp_path}"],
        tmp_path,
    )  # fmt: skip
    try:
        run.wait_for(r"INFO step 2/", timeout=120)
        assert job_pids(job), "the job is not running"
        # the workers did get it (in their environment, which only their owner can read)
        assert proc_env(worker_pid(job, 0)).get("HF_TOKEN") == secret
        visible = []  # what `ps -eo args` shows any user
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if secret.encode() in (entry / "cmdline").read_bytes():
                        visible.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
    finally:
        stop(run, job)
    assert visible == [], visible


# Issue #24: every kind of secret the launcher recognises, and one only marked so (ddp_secret_env).
WIDE_SECRETS = {
    "HF_TOKEN": "hf_Zq82-token-value",
    "DB_PASSWD": "pw-Zq82-passwd",
    "GIT_CREDENTIALS": "cred-Zq82-git",
    "PROXY_AUTH": "auth-Zq82-proxy",
    "MIRROR_URL": "https://bob:pw-Zq82-in-url@mirror.example/simple",
    "PLAIN_NAME": "marked-Zq82-secret",  # named like nothing: ddp_secret_env marks it
}


class PsSampler:
    """`ps -ww -eo args` (unlimited width) on every testbed host, round-robin, in a thread: what any
    local user sees."""

    def __init__(self, tb: Testbed) -> None:
        self.tb = tb
        self.samples: list[tuple[str, str]] = []  # (host, ps output)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            for h in self.tb.hosts()[:3]:
                res = self.tb.exec(h, "ps -ww -eo args", check=False, timeout=20)
                self.samples.append((h.name, res.stdout))

    def stop(self) -> None:
        self.done.set()
        self.thread.join(30)

    def seen(self, text: str) -> int:
        return sum(text in out for _, out in self.samples)


@pytest.mark.slow
@pytest.mark.testbed
def test_no_secret_in_ps_on_any_node_during_preflight_or_training(testbed: Testbed, tmp_path: Path) -> None:
    """Issue #24 item 1: preflight's probe, listener and connector ran `env K=V ... python -c` (every
    ddp_env value in `ps` on every node while preflight ran); now their environment goes on stdin."""
    tb = testbed
    inv = named_inventory(
        tb, tmp_path, {h.name: h.ip for h in tb.hosts()[:3]},
        {"ddp_workdir": str(tmp_path), "ddp_venv": sys.prefix, "ddp_env": WIDE_SECRETS,
         "ddp_secret_env": ["PLAIN_NAME"]},
    )  # fmt: skip
    job = job_id("sec-ps3")
    sampler = PsSampler(tb)
    run = Launcher(
        ["--hosts", str(inv), "--job-id", job, "--set", "train.max_steps=40",
         "--set", "debug.step_delay_s=0.1", "--set", "log.interval_steps=1",
         "--set", f"run.dir={tmp_path / 'runs'}", "--secret-env", "CLI_ONLY"],
        tmp_path, env={"CLI_ONLY": "cli-Zq82-marked"},
    )  # fmt: skip
    try:
        code = run.wait(300)
    finally:
        sampler.stop()
        run.stop()
    assert code == 0, run.text
    # the sampler saw both phases: preflight's probes (their script is argv) and the job's agents
    assert sampler.seen("DDP-PROBE") and sampler.seen("DDP-CONNECT"), "no sample during preflight"
    assert sampler.seen("ddp_train.agent"), "no sample during training"
    hits = [(host, s) for s in [*WIDE_SECRETS.values(), "cli-Zq82-marked"] for host, out in sampler.samples
            if s in out]  # fmt: skip
    print(f"ps samples: {len(sampler.samples)} on {len({h for h, _ in sampler.samples})} hosts; "
          f"preflight {sampler.seen('DDP-PROBE') + sampler.seen('DDP-CONNECT')}, "
          f"training {sampler.seen('ddp_train.agent')}; secret hits {len(hits)}")  # fmt: skip
    assert hits == []
    # and the console and every file of the job mask them all
    files = [p for p in (tmp_path / "logs" / job).rglob("*") if p.is_file()]
    everything = run.text.encode() + b"".join(p.read_bytes() for p in files)
    for s in [*WIDE_SECRETS.values(), "cli-Zq82-marked"]:
        assert s.encode() not in everything, s
    # a real job's directory (metrics and plot included) is its owner's only
    assert (tmp_path / "logs" / job).stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: 0o600 for p in files}


@pytest.mark.slow
def test_a_stack_directory_prepared_by_another_user_is_never_written_through(
    tmp_path: Path,
    unprivileged_user: str,  # noqa: F811 - the fixture imported above
) -> None:
    """Issue #24 item 4: ranks opened /tmp/ddp-stacks-<job>/r<rank>.txt (a name anyone can guess from
    `ps`) with open(..., "w"): a symlink another user put there made root truncate its target."""
    target = tmp_path / "precious"
    target.write_text("root's data\n")
    target.chmod(0o644)
    before = (target.read_bytes(), target.stat().st_mtime_ns)
    job = job_id("sec-sym")
    trap = Path(f"/tmp/ddp-stacks-{job}")
    subprocess.run(as_user(unprivileged_user, "mkdir", "-m", "0777", str(trap)), check=True)
    for rank in (0, 1):
        link = str(trap / f"r{rank}.txt")
        subprocess.run(as_user(unprivileged_user, "ln", "-s", str(target), link), check=True)
    try:
        inv = local_inventory(tmp_path, nodes=2)
        code, out = launch(
            ["--hosts", str(inv), "--job-id", job, "--set", "train.max_steps=3",
             "--set", f"run.dir={tmp_path}"],
            tmp_path, timeout=300,
        )  # fmt: skip
        assert code == 0, out
        assert len(finals(out.splitlines())) == 2, out
        after = (target.read_bytes(), target.stat().st_mtime_ns)
        print(f"symlink attack: target {target} before {before}, after {after}")
        assert after == before
        assert sorted(p.name for p in trap.iterdir()) == ["r0.txt", "r1.txt"]  # the trap itself untouched
        assert all((trap / n).is_symlink() for n in ("r0.txt", "r1.txt"))
    finally:
        shutil.rmtree(trap, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.testbed
def test_preflight_warns_when_master_port_answers_the_controller_that_is_no_node(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Issue #24 item 10, the launcher's part: the rendezvous has no authentication, so MASTER_PORT
    open to a non-member (here: the controller, not in the inventory) is named; kept to the members by
    a firewall rule on the master, preflight is quiet and every node still reaches it."""
    tb = testbed
    hosts = tb.hosts()[:3]
    inv = named_inventory(tb, tmp_path, {h.name: h.ip for h in hosts}, {"ddp_workdir": str(tmp_path),
                                                                       "ddp_venv": sys.prefix})  # fmt: skip
    port = "29731"
    code, out = launch(["doctor", "--hosts", str(inv), "--master-port", port], tmp_path)
    assert code == 0, out
    warned = [
        ln for ln in out.splitlines() if ln.startswith(f"warn node0: MASTER_PORT {port} at {hosts[0].ip}")
    ]
    assert len(warned) == 1 and "answers this controller" in warned[0], out
    print(f"outsider probe, port open: {warned[0]}")
    members = ", ".join(h.ip for h in hosts)
    rule = f"tcp dport {port} ip saddr != {{ {members} }} drop"
    tb.exec(
        hosts[0],
        f"nft add table inet ddpsec && nft add chain inet ddpsec in "
        f"'{{ type filter hook input priority 0; policy accept; }}' && nft add rule inet ddpsec in {rule}",
    )
    try:
        code, out = launch(["doctor", "--hosts", str(inv), "--master-port", port], tmp_path)
    finally:
        tb.exec(hosts[0], "nft delete table inet ddpsec", check=False)
    assert code == 0 and "preflight: all checks passed" in out, out  # every peer still reaches MASTER_PORT
    assert "answers this controller" not in out, out
    print(f"outsider probe, port kept to the nodes ({rule}): no warning; peers connect: all checks passed")
