"""Job logs: every node line live on the console as `[host r<i>] line`, and in logs/<job>/<host>.log.

The launcher's own messages go to the console and logs/<job>/launcher.log. Secret values (plan.is_secret:
named like TOKEN/KEY/SECRET/PASSWORD/..., user:pass@ URLs, or marked) are masked everywhere; the job's
directory is 0700 and its files 0600 (node output may hold what it should not).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ddp_train.launch.jobs.jobstate import open_private, private_dir, write_private
from ddp_train.launch.plan.plan import mask_text

# Lines that tell why a node failed, best first: the trainer's one-line error, a signal that killed a
# worker (torchrun's root cause), an exception or error message (not one inside an indented traceback),
# the trainer's "stopped:" line (a rank that stopped because a peer failed or a stop came: on a node
# whose own rank failed, it may come before that rank's error), a stop signal, torchrun's exit code
# report, then anything error-like.
_STOPPED = re.compile(r"ddp-train: stopped: ")
_EXCEPTION = re.compile(
    r"(?<![\w.])(?:\w+\.)*(?!ChildFailedError|SignalException)\w*(Error|Exception): \S|"
    r"ddp-train: error|^error: "
)
_RANKED = (
    re.compile(r"ddp-train: error: "),  # the trainer's own one-line reason (trainer.run)
    re.compile(r"Signal \d+ \((?!SIGTERM|SIGINT|SIGHUP)SIG\w+\) received by PID \d+"),
    _EXCEPTION,
    _STOPPED,
    re.compile(r"Signal \d+ \(SIG\w+\) received by PID \d+"),
    re.compile(r"exitcode\s*:\s*-?[1-9]"),
    re.compile(
        r"\b(FATAL|Fatal|fatal|Killed|Segmentation fault|No such file or directory|Permission denied|"
        r"command not found)\b|\b\w*(Error|Exception)\b"
    ),
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # what may appear in a log file name as is
# Kept off the console (the host log has them): the body of a Python traceback up to its exception line,
# which is shown, and the C++ frames c10d prints under a warning.
_RANK_PREFIX = re.compile(r"^\[(?:rank\d+|default\d*)\]: ?")  # torch's "[rank1]: " before worker lines
# torch's own logger (torchelastic, glog style) before each line it logs, a traceback's too:
# "E1205 05:50:45.545000 23051 torch/distributed/elastic/agent/server/api.py:1008] "; its PID keys the state.
_TORCH_LOG_PREFIX = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(\d+) \S+:\d+\] ")
_TRACEBACK_START = re.compile(
    r"^(Traceback \(most recent call last\):|During handling of the above exception|"
    r"The above exception was the direct cause|Exception ignored in)"
)
_CPP_FRAME = re.compile(r"^(frame #\d+: |Exception raised from |<omitting python frames>)")
_FRAME_FILE = re.compile(r'^\s+File "')
_NOISE = re.compile(r"^\s*(Traceback \(most recent call last\)|File \"|raise |\^+$|warnings\.warn)|Warning:")


def first_error(lines: Sequence[str]) -> str | None:
    """The line of a node's output that best explains its failure, or None."""
    useful = [ln for ln in lines if ln.strip() and not _NOISE.search(ln)]
    for pattern in _RANKED:
        for ln in useful:
            if _STOPPED.search(ln) and pattern is not _STOPPED:
                continue  # its "RuntimeError: ..." is a peer's failure seen from here
            if pattern is _EXCEPTION and _RANK_PREFIX.sub("", ln, count=1)[:1].isspace():
                continue  # a line inside a traceback (the trainer indents the ones of consequences)
            if pattern.search(ln.strip()):
                return ln.strip()
    return None


class JobLog:
    """Console + per-host files for one job; thread-safe."""

    def __init__(
        self,
        log_dir: Path,
        job_id: str,
        secrets: Sequence[str] = (),
        console: IO[str] | None = None,
        quiet: bool = False,
    ) -> None:
        self.dir = private_dir(Path(log_dir) / job_id)  # 0700: node output may hold what it should not
        self.secrets = list(secrets)
        self.console = console or sys.stdout
        self.quiet = quiet
        self._lock = threading.Lock()
        self._files: dict[str, IO[str]] = {}
        self._tail: dict[str, list[str]] = {}
        self._in_traceback: dict[str, bool] = {}  # per host and rank prefix
        self._in_frame: dict[str, bool] = {}  # the same, after a traceback's `  File "...` line
        self.hidden: dict[str, int] = {}  # per host: traceback lines written to its log, not the console
        self._launcher = _append(self.dir / "launcher.log")
        self.live = ""  # the one live status line kept under the scrolling output on a TTY (set_live)
        try:
            self.tty = self.console.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def set_live(self, text: str) -> None:
        """On a TTY: show `text` as the last line, redrawn in place under the scrolling lines."""
        if not self.tty or self.quiet:
            return
        with self._lock:
            self.live = text
            self._draw_live()

    def _draw_live(self) -> None:  # with the lock held
        if self.live:
            self.console.write(f"\r\x1b[K{self.live}")
            self.console.flush()

    def _write(self, text: str) -> None:  # with the lock held: clear the live line, write, redraw it
        self.console.write(f"\r\x1b[K{text}" if self.live else text)
        self._draw_live()
        self.console.flush()

    def path(self, host: str) -> Path:
        return host_log_path(self.dir, host)

    def line(self, host: str, label: str, text: str) -> None:
        """One output line of a node."""
        text = mask_text(text, self.secrets)
        shown = f"[{label}] {text}"
        with self._lock:
            f = self._files.get(host)
            if f is None:
                f = self._files[host] = _append(self.path(host))
            f.write(f"{_stamp()} {shown}\n")
            f.flush()
            tail = self._tail.setdefault(host, [])
            tail.append(text)
            if len(tail) > 400:
                del tail[:200]
            if self._traceback_line(host, text):
                self.hidden[host] = self.hidden.get(host, 0) + 1
            elif not self.quiet:
                self._write(shown + "\n")

    def _traceback_line(self, host: str, text: str) -> bool:  # with the lock held
        """True for a line inside a traceback (its exception line excepted) or a C++ frame. The state is
        per rank where torch prefixes the lines with `[rankN]: `: the ranks of a host interleave; per
        process for the lines torch's logger prefixes (torchrun's agent logging a traceback)."""
        prefix = _RANK_PREFIX.match(text)
        logged = None if prefix else _TORCH_LOG_PREFIX.match(text)
        key = f"{host}\0{prefix.group(0).strip() if prefix else f'log{logged.group(1)}' if logged else ''}"
        body = text[prefix.end() :] if prefix else text[logged.end() :] if logged else text
        if _TRACEBACK_START.match(body) or _CPP_FRAME.match(body):
            self._in_traceback[key] = True
            return True
        if _FRAME_FILE.match(body):  # a frame and the indented source lines under it, in any state
            self._in_frame[key] = True
            return True
        if self._in_frame.pop(key, False) and body.strip() and body[:1].isspace():
            self._in_frame[key] = True  # its source line, then any ^^^^ marker line
            return True
        if self._in_traceback.get(key):
            if not body.strip() or body[:1].isspace():
                return True
            self._in_traceback[key] = False  # the exception line ends it and is shown
        return False

    def tail(self, host: str) -> list[str]:
        with self._lock:
            return list(self._tail.get(host, []))

    def next_attempt(self) -> None:
        """A new attempt of the job (launch/run/nodeloss.py) starts: what each host said before is no
        longer its first error or its hidden traceback (its log file keeps every attempt's lines)."""
        with self._lock:
            self._tail.clear()
            self._in_traceback.clear()
            self._in_frame.clear()
            self.hidden.clear()

    def note(self, text: str, console: bool = True) -> None:
        """A launcher message."""
        text = mask_text(text, self.secrets)
        with self._lock:
            self._launcher.write(f"{_stamp()} {text}\n")
            self._launcher.flush()
            if console:
                self._write(f"ddp-launch: {text}\n")

    def block(self, text: str) -> None:
        """A multi-line block (a table) for console and launcher.log."""
        text = mask_text(text, self.secrets)
        with self._lock:
            self._launcher.write(text + "\n")
            self._launcher.flush()
            self._write(text + "\n")

    def write_json(self, name: str, data: Any) -> Path:
        path = self.dir / name
        # only string leaves are masked: a secret value such as "false" must not turn JSON's false into ***
        text = json.dumps(_mask_leaves(data, self.secrets), indent=2, sort_keys=True) + "\n"
        write_private(path, text.encode())
        return path

    def close(self) -> None:
        with self._lock:
            if self.live:
                self.console.write("\r\x1b[K")
                self.live = ""
            for f in self._files.values():
                f.close()
            self._launcher.close()


def _mask_leaves(data: Any, secrets: Sequence[str]) -> Any:
    """`data` with every string in it (keys too) masked; numbers, booleans and None as they are."""
    if isinstance(data, str):
        return mask_text(data, secrets)
    if isinstance(data, dict):
        return {_mask_leaves(k, secrets): _mask_leaves(v, secrets) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_mask_leaves(v, secrets) for v in data]
    return data


def _append(path: Path) -> IO[str]:
    return open(open_private(path), "a", encoding="utf-8")  # noqa: SIM115 - closed in JobLog.close


def safe_name(host: str, reserved: Sequence[str] = ()) -> str:
    """A host name as a plain file name: itself when safe, else a sanitised one with a short hash."""
    name = _UNSAFE.sub("_", host)
    if name != host or name.startswith(".") or name in reserved:  # never outside the dir, no clash
        name = f"{name.lstrip('.') or 'host'}-{hashlib.sha256(host.encode()).hexdigest()[:8]}"
    return name


def host_log_path(job_dir: Path, host: str) -> Path:
    """logs/<job>/<host>.log; a host name that is no plain file name gets a safe unique one."""
    return Path(job_dir) / f"{safe_name(host, ('launcher', 'console'))}.log"


def _stamp() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["-" if c is None or c == "" else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def show_new(path: Path, offset: int, out: IO[str]) -> int:
    """Print what was appended to path since offset (whole lines only); the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    cut = data.rfind(b"\n") + 1
    if cut:
        out.write(data[:cut].decode("utf-8", "replace"))
        out.flush()
    return offset + cut
