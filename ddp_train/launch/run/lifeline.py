"""The launcher's side of the node agent's lifeline and stack dumps (see ddp_train/agent.py).

Every node's command keeps its stdin open for the whole job; a thread writes a newline to each every
LIFELINE_BEAT_S seconds. The agent stops its node gracefully (SIGTERM to torchrun: every rank finishes
its step, rank 0 saves) when stdin reaches EOF (the monitor died: immediately, as its pipe or TCP
connection closes) or when no byte came for LIFELINE_S seconds (the controller vanished silently). So a
node trains unsupervised for at most LIFELINE_S seconds, plus its stop (one step and one save).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence

from ddp_train.agent import LIFELINE_ENV

LIFELINE_S = 30  # the documented bound: seconds without a lifeline beat before a node stops itself
LIFELINE_BEAT_S = 5.0


def node_env_line(base: bytes, job_id: str) -> bytes:
    """The node agent's environment line with the lifeline added. (The agent makes the ranks' stack
    directory itself, a private one: ddp_train/agent.py private_dir.)"""
    env = json.loads(base)
    env[LIFELINE_ENV] = str(LIFELINE_S)
    return (json.dumps(env, ensure_ascii=True) + "\n").encode()


class Lifeline:
    """One thread writing a newline (a lifeline beat) to every started node's stdin until stopped.
    (Not the SSH liveness check of remote.py, which tells the launcher that a node went silent.)"""

    def __init__(self, senders: Callable[[], Sequence[Callable[[bytes], None]]]) -> None:
        self.senders = senders
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="lifeline", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _beat(self) -> None:
        while not self.stopped.wait(LIFELINE_BEAT_S):
            for send in self.senders():
                try:
                    send(b"\n")
                except Exception:  # noqa: BLE001, S112 - a node that went away is its node thread's business
                    continue
