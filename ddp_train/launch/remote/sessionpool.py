"""Every node's control connection for one launch: opened once, again if it dropped, all closed at the end.

As fabric's `Group`: whoever opens the pool closes it (a `with` block), and so every connection in it;
nobody else closes them. --sync, preflight, the config copy and the job's control commands share it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import TracebackType

from ddp_train.launch.plan.inventory import Node
from ddp_train.launch.remote.remote import Session, open_session


class SessionPool:
    def __init__(self, connect_timeout: float = 10) -> None:
        self.connect_timeout = connect_timeout
        self._sessions: dict[str, Session] = {}
        self._opened: list[Session] = []  # every one, to close even those replaced since
        self._lock = threading.Lock()

    def get(self, node: Node) -> Session:
        """The node's open connection; a new one if there is none or it dropped (RemoteError if not)."""
        session = self._sessions.get(node.name)
        if session is None or not session.alive():
            session = self.open(node)
        return session

    def open(self, node: Node) -> Session:
        """A new connection to the node, which becomes its control connection."""
        session = open_session(node, self.connect_timeout)
        self.adopt({node.name: session})
        return session

    def adopt(self, sessions: dict[str, Session]) -> None:
        """Take connections opened on the pool's behalf (preflight's) into it: it closes them."""
        with self._lock:
            for name, session in sessions.items():
                self._sessions[name] = session
                if not any(s is session for s in self._opened):
                    self._opened.append(session)

    def sessions(self) -> dict[str, Session]:
        return dict(self._sessions)

    def close(self) -> None:
        with self._lock:
            opened, self._opened, self._sessions = self._opened, [], {}
        _close_all(opened)

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()


def _close_all(sessions: Iterable[Session]) -> None:
    for s in sessions:
        s.close()
