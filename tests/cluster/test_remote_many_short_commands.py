"""Many short commands at once over real SSH lose no output and no exit status (issue #19).

At 64 nodes under load, a probe's whole answer was dropped when its output arrived with the channel's
close (see tests/unit/test_launch_remote_stream.py for the deterministic reproduction). Here the same
path runs for real: 3 testbed hosts, 60 short commands in 12 threads over one connection per host,
each printing a unique line (and one without a newline) and exiting with its own status.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from ddp_train.launch.plan.inventory import load_nodes
from ddp_train.launch.remote.remote import open_session

pytestmark = [pytest.mark.testbed]


def test_parallel_short_commands_keep_every_line_and_exit_status(testbed) -> None:
    nodes = load_nodes([str(testbed.inventory)])
    sessions = [open_session(n, connect_timeout=20) for n in nodes]
    try:

        def one(i: int) -> tuple[int, int, str]:
            code, out = sessions[i % len(sessions)].exec(
                f"echo line-{i}; printf tail-{i}; exit {i % 7}", timeout=60
            )
            return i, code, out

        with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
            results = list(pool.map(one, range(60)))
    finally:
        for s in sessions:
            s.close()
    # the output ends with the command's own lines (the login shell's rc files may print before them)
    wrong = [
        (i, code, out) for i, code, out in results if code != i % 7 or not out.endswith(f"line-{i}\ntail-{i}")
    ]
    assert not wrong, f"{len(wrong)} of 60 commands lost output or status, e.g. {wrong[:3]}"
