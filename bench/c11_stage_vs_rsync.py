"""C11: `ddp-launch stage` of a data set to N testbed hosts vs rsync from the controller to each, same run.

N namespace hosts (their own testbed: prefix `stgb`, SSH on 10.213.182.0/24, training network
10.213.183.0/24), a directory of --size MiB in 64 MiB files of random bytes. Baseline: `rsync -a` over
the testbed's SSH from the controller to every host at once (a user's `for h in ...; do rsync ... &`).
Then `ddp-launch stage` of the same directory to an empty DEST on every host. Both are timed from start
to the last host holding a verified copy (for rsync: the sha256 of each host's copy checked after the
clock stops). Prints the bytes the controller sent for each, then
`C11 stage/rsync stage_s ratio=R` last (R = stage time / rsync time; target <= 1.0; the controller sends
1/N of rsync's bytes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import BENCH_ENV, PYTHON, REPO, ratio_line

sys.path.insert(0, str(REPO))
from tests.testbed import Testbed  # noqa: E402

LAUNCH = str(Path(PYTHON).parent / "ddp-launch")
FILE_MIB = 64


def tree_sha(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".ddp-stage" not in p.parts
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--size", type=int, default=2048, help="MiB in all [2048]")
    ap.add_argument("--prefix", default="stgb")
    ap.add_argument("--net", default="10.213.182")
    ap.add_argument("--train-net", default="10.213.183")
    args = ap.parse_args()
    tb = Testbed(prefix=args.prefix, net=args.net, train_net=args.train_net)
    with tempfile.TemporaryDirectory(prefix="c10-") as td:
        tmp = Path(td)
        src = tmp / "corpus"
        src.mkdir()
        left = args.size
        i = 0
        while left > 0:
            with open(src / f"shard-{i:03d}.bin", "wb") as f:
                for _ in range(min(FILE_MIB, left)):
                    f.write(os.urandom(1 << 20))
            left -= FILE_MIB
            i += 1
        want = tree_sha(src)
        try:
            hosts = tb.up(args.hosts)
            inv = yaml.safe_load(tb.inventory.read_text())
            inv["all"]["vars"]["ddp_venv"] = sys.prefix
            for h in hosts:
                (tmp / h.name).mkdir()
                inv["all"]["children"]["gpu_nodes"]["hosts"][h.name]["ddp_workdir"] = str(tmp / h.name)
            (tmp / "inv.yml").write_text(yaml.safe_dump(inv))

            ssh = f"ssh -F {shlex.quote(str(tb.ssh_config))}"
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
                runs = list(
                    pool.map(
                        lambda h: subprocess.run(
                            [
                                "rsync",
                                "-a",
                                "--stats",
                                "-e",
                                ssh,
                                f"{src}/",
                                f"{h.name}:{tmp / h.name}/rsync/",
                            ],
                            capture_output=True,
                            text=True,
                        ),
                        hosts,
                    )
                )
            rsync_s = time.perf_counter() - t0
            for h, r in zip(hosts, runs):
                if r.returncode != 0:
                    sys.exit(f"bench: rsync to {h.name} failed: {r.stderr[-800:]}")
            rsync_sent = sum(
                int(re.sub(r"\D", "", re.search(r"^Total bytes sent: ([\d,.]+)", r.stdout, re.M).group(1)))
                for r in runs
            )
            for h in hosts:
                assert tree_sha(tmp / h.name / "rsync") == want, h.name
                shutil.rmtree(tmp / h.name / "rsync")  # the disk holds one set of copies at a time

            argv = [LAUNCH, "stage", str(src), "--to", "staged", "--hosts", str(tmp / "inv.yml")]
            t0 = time.perf_counter()
            res = subprocess.run(argv, capture_output=True, text=True, env=BENCH_ENV)
            stage_s = time.perf_counter() - t0
            if res.returncode != 0:
                sys.exit(f"bench: stage failed ({res.returncode}): {res.stdout[-1500:]}{res.stderr[-1500:]}")
            print(res.stdout, end="")
            stage_sent = sum(int(b) for b in re.findall(r"(\d+) bytes sent from this machine", res.stdout))
            for h in hosts:
                assert tree_sha(tmp / h.name / "staged") == want, h.name
        finally:
            if os.environ.get("C11_KEEP"):
                input(f"kept {tmp}; enter to tear down")
            tb.down()
    load = os.getloadavg()[0]
    print(f"rsync x{args.hosts}: {rsync_s:.1f}s, controller sent {rsync_sent} bytes")
    print(f"stage: {stage_s:.1f}s, controller sent {stage_sent} bytes")
    print(
        ratio_line(
            "C11",
            "stage/rsync",
            "stage_s",
            stage_s / rsync_s,
            hosts=args.hosts,
            mib=args.size,
            stage_s=f"{stage_s:.1f}",
            rsync_s=f"{rsync_s:.1f}",
            sent_ratio=f"{stage_sent / max(rsync_sent, 1):.3f}",
            load=f"{load:.1f}",
        )
    )


if __name__ == "__main__":
    main()
