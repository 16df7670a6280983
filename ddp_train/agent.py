"""What ddp-launch runs on each node: `python -m ddp_train.agent TORCHRUN [torchrun args]`.

It reads the job's environment as one JSON line from stdin (so ddp_env values, secrets included, are
never in a command line that `ps` shows), then runs the node's torchrun script in this process, so
that a stop ends as one line and an exit code instead of torchrun's traceback:

- torchrun's agent turns SIGTERM/SIGINT/SIGHUP/SIGQUIT into SignalException
  (torch/distributed/elastic/multiprocessing/api.py: PContext.start, _terminate_process_handler),
  then sends that same signal once to every worker and waits up to its shutdown timeout before
  SIGKILL (elastic/agent/server/api.py SimpleElasticAgent.run -> _shutdown(e.sigval,
  timeout=self._shutdown_timeout) -> SubprocessContext._close), and re-raises the exception
  (launcher/api.py launch_agent), which torchrun's main prints as a traceback and exit 1.
  Here it becomes exit 128 + signal, like the workers' own exit code after their checkpoint.
- The shutdown timeout comes from TORCH_ELASTIC_SHUTDOWN_TIMEOUT (launcher/api.py LaunchConfig), which
  ddp-launch sets to the longest grace period it may give a stop.

- The lifeline (DDP_LIFELINE_S in the environment line, set by ddp-launch): the launcher keeps this
  command's stdin open and writes a newline every few seconds. EOF (the launcher or its monitor died, or
  the SSH connection closed) or no byte for DDP_LIFELINE_S seconds (the controller vanished without
  closing the TCP connection) means nobody supervises the job any more: the agent sends itself SIGTERM,
  the path of a normal stop (every rank finishes its step, rank 0 saves, exit 143). From then on the
  node's output, which nobody reads, goes to agent.log in the agent's private directory instead of a
  broken pipe (`lifeline_log`), so no rank dies on EPIPE while saving.
- The private directory: `mkdtemp` under $TMPDIR (/tmp), 0700, a random name created by this agent (so
  no other user can have created it first or put a symlink in it, issue #24); the ranks' stack dumps
  (DDP_STACK_DIR, ddp_train/stackdump.py), agent.log and torchrun's --log-dir go there. It is removed
  at the end (`_clean`) unless an agent.log stays in it for whoever looks.

- The compile caches (ddp_train/cachedirs.py): TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for every
  rank, made 0700 or checked (this user's, writable by nobody else) before torchrun starts, so a user
  script that calls torch.compile gets them too; a directory another user made is refused in one line.

Only the standard library (and ddp_train.console, ddp_train.cachedirs and the ddp_train.storage checks it
uses, which need no more) is imported before torchrun runs (torch comes with torchrun's script).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ddp_train import cachedirs
from ddp_train.console import emit_line

ENV_LINE_LIMIT = 1 << 20  # one JSON object, the job's environment
LIFELINE_ENV = "DDP_LIFELINE_S"  # seconds without a byte from the launcher before the node stops itself
STACK_DIR_ENV = "DDP_STACK_DIR"  # where the ranks write their stack dumps (ddp_train/stackdump.py)
TORCHRUN_LOGS = "torchrun"  # torchrun's --log-dir in the private directory (see _torchrun_argv)


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _early_stop(signum: int, _frame: object) -> None:
    raise _Stopped(signum)  # before torchrun installs its own handlers: nothing was started yet


def read_env(stream) -> dict[str, str]:  # noqa: ANN001 - a binary file
    """The environment ddp-launch sent: one JSON object of strings on the first line."""
    line = stream.readline(ENV_LINE_LIMIT + 1)
    if not line.endswith(b"\n"):
        raise ValueError("no complete environment line on stdin")
    env = json.loads(line)
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ValueError("the environment line is not an object of strings")
    return env


def main(argv: list[str]) -> int:
    """Read the environment, run torchrun; the exit code (128 + N after signal N)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _early_stop)
    if not argv:
        print("ddp-agent: error: usage: python -m ddp_train.agent TORCHRUN [args]", file=sys.stderr)
        return 2
    try:
        env = read_env(sys.stdin.buffer)
        # every rank's torch.compile caches, in directories only this user can write (a ddp_env value
        # is checked, not replaced): the trainer's ranks check again, a user script's do not
        env.update(cachedirs.compile_cache_env({**os.environ, **env}))
    except (ValueError, UnicodeDecodeError) as e:
        print(f"ddp-agent: error: stdin: {e}", file=sys.stderr)
        return 2
    except cachedirs.CacheDirError as e:
        print(f"ddp-agent: error: {e}", file=sys.stderr)
        return 2
    except _Stopped as e:
        return _report(_stopped_line(e.signum, started=False))
    private = private_dir(env.get("DDP_JOB_ID") or os.environ.get("DDP_JOB_ID", "job"))  # (on the argv)
    if private:
        env[STACK_DIR_ENV] = private  # the ranks' stack dumps, in a directory nobody else can touch
    os.environ.update(env)
    lifeline = _Lifeline.start(env, private) if env.get(LIFELINE_ENV) else None
    devnull = os.open(os.devnull, os.O_RDONLY)  # workers must not hold the launcher's stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    ending: tuple[int, str | None] = (1, None)
    try:
        ending = _run_torchrun(_torchrun_argv(argv, private))
    finally:
        # The workers are gone and the ending decided. A later stop signal (the launcher's stop reaching
        # the node's session once more) would now meet torchrun's handler, a traceback, or, once Python
        # finalizes and restores the default handlers it set, kill this process (seen under load: the
        # node's status 'setsid: child did not exit normally' instead of the agent's line and exit 143).
        # Ignored handlers are left as they are at finalization.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if lifeline is not None:
            lifeline.finish()  # the relay drains first: the agent's line is the node's last one
        if private:
            _clean(private)
    return _report(ending)


def _report(ending: tuple[int, str | None]) -> int:
    """The agent's last line, if any, in one write(2) (ddp_train/console.py): a worker still writing
    to the same pipe cannot glue its output onto it (CI: "...; exit 143Traceback (most recent ...")."""
    code, line = ending
    if line:
        emit_line(line, sys.stderr)
    return code


def _torchrun_argv(argv: list[str], private: str | None) -> list[str]:
    """torchrun's argv with --log-dir in the private directory, first: without one torchrun makes its log
    directory (the ranks' error files) with mkdtemp(prefix="torchelastic_") in /tmp and never removes it
    (torch 2.13 elastic/multiprocessing/api.py, DefaultLogsSpecs), one more per launch on every node.
    A --log-dir of the user's comes later and wins (argparse keeps an option's last value)."""
    if not private:
        return argv
    return [argv[0], "--log-dir", os.path.join(private, TORCHRUN_LOGS), *argv[1:]]


# The signals torchrun's handler turns into SignalException (torch 2.13 elastic/multiprocessing/api.py:
# PContext.start registers _terminate_process_handler for TORCHELASTIC_SIGNALS_TO_HANDLE, default
# "SIGTERM,SIGINT,SIGHUP,SIGQUIT"; the handler raises on every signal).
TORCH_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def _first_stop_only() -> Iterator[None]:
    """torchrun's stop handler raises for the first stop signal only. A later one (the launcher's stop
    reaching the node's session again) raised a second SignalException wherever the first was being
    handled: inside torchrun's shutdown of its workers, or in this module's own except clause, a
    traceback and exit 1 instead of the agent's line and 143 (tests/unit/test_launch_stop.py, seen under
    load). The handlers torchrun installs while it runs are wrapped; one flag for all of them."""
    real = signal.signal
    fired: list[int] = []

    def once(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
        def first_only(signum: int, frame: Any) -> Any:
            if fired:
                return None  # stopping already: torchrun ends its workers once
            fired.append(signum)
            return handler(signum, frame)

        return first_only

    def install(signum: int, handler: Any) -> Any:
        if signum in TORCH_STOP_SIGNALS and callable(handler):
            handler = once(handler)
        return real(signum, handler)

    signal.signal = install  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = real


def _run_torchrun(argv: list[str]) -> tuple[int, str | None]:
    """Run torchrun's script here; (exit code, the line that says how it ended, if it needs one)."""
    torchrun = argv[0]
    sys.argv = list(argv)
    try:
        with _first_stop_only():
            runpy.run_path(torchrun, run_name="__main__")
    except SystemExit as e:
        code = e.code
        return (code if isinstance(code, int) else (0 if code is None else 1)), None
    except _Stopped as e:
        return _stopped_line(e.signum, started=False)
    except Exception as e:
        if type(e).__name__ == "ChildFailedError" and hasattr(e, "get_first_failure"):
            return _failed_line(e)
        sigval = getattr(e, "sigval", None)  # torch.distributed.elastic's SignalException
        if type(e).__name__ != "SignalException" or sigval is None:
            raise
        return _stopped_line(int(sigval), started=True)
    return 0, None


def _failed_line(e: Exception) -> tuple[int, str]:
    """torchrun's ChildFailedError (a worker exited non-zero) as one line instead of its traceback and
    report block (the worker's own lines above say why); exits with that worker's code, or 128 + the
    signal that killed it. torch 2.13 elastic/multiprocessing/errors/__init__.py: ChildFailedError
    .get_first_failure() -> (global rank, ProcessFailure with exitcode, message, local_rank)."""
    failures = e.failures  # type: ignore[attr-defined]
    # ProcessFailure.timestamp is int(time.time()) at detection: workers failing in the same poll tie
    # (get_first_failure then takes the lowest rank). Prefer a worker that failed on its own: bad input
    # (2), a signal, any code but 1 (which its peers exit with as a consequence) or 128 + a stop signal.
    rank, failure = min(
        failures.items(),
        key=lambda rf: (_consequence_class(int(rf[1].exitcode)), rf[1].timestamp, rf[0]),
    )
    code = int(failure.exitcode)
    how = f"exit code {code}" if code >= 0 else str(failure.message)  # "Signal 9 (SIGKILL) received by PID n"
    who = f"rank {rank} (local rank {failure.local_rank})"
    if len(failures) > 1:
        line = f"ddp-agent: {len(failures)} workers failed; {who}: {how}"
    else:
        line = f"ddp-agent: worker {who} failed first: {how}"
    return (code if code > 0 else (128 - code if code < 0 else 1)), line


def _consequence_class(code: int) -> int:
    """0: a worker's own failure (2, 3, a signal...); 1: exit 1 (also a peer's consequence); 2: a stop."""
    return 2 if code >= 128 else (1 if code == 1 else 0)


def private_dir(job_id: str) -> str | None:
    """A new 0700 directory of this agent's own under $TMPDIR: ddp-agent-<job>-<random> (None if it
    cannot be made). mkdtemp creates it with O_EXCL semantics and a random name: never one an attacker
    prepared (https://docs.python.org/3/library/tempfile.html#tempfile.mkdtemp)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in job_id)[:64] or "job"
    try:
        return tempfile.mkdtemp(prefix=f"ddp-agent-{safe}-")
    except OSError:
        return None


def _clean(directory: str) -> None:
    """At the end (the workers are gone): the stack dumps go (a killed rank leaves its file) and
    torchrun's log directory (its ranks' error files were read when they failed), then the directory
    unless an agent.log stays for whoever looks."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if name == TORCHRUN_LOGS and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif name != "agent.log":
                with contextlib.suppress(OSError):
                    os.unlink(path)
        os.rmdir(directory)


def lifeline_log(directory: str | None) -> str:
    """Where a node's output goes once the launcher is gone."""
    return os.path.join(directory, "agent.log") if directory else os.devnull


def _open_log(directory: str | None) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(lifeline_log(directory), flags, 0o600)
    except OSError:
        return os.open(os.devnull, os.O_WRONLY)


class _Lifeline:
    """Watches the launcher through stdin; relays the node's output so a dead reader breaks nothing."""

    def __init__(self, timeout: float, directory: str | None) -> None:
        self.timeout = timeout
        self.directory = directory
        self.stdin = os.dup(0)  # private (close-on-exec) copies: workers inherit neither
        self.out = os.dup(1)
        read, write = os.pipe()
        self.relay_in = read
        os.dup2(write, 1)  # torchrun and its workers write here; the relay thread forwards it
        os.dup2(write, 2)
        os.close(write)
        self.lock = threading.Lock()
        self.lost: str | None = None
        self.done = False  # torchrun returned: a closing stdin means nothing any more
        self.relay = threading.Thread(target=self._relay, name="ddp-agent-relay", daemon=True)
        self.watch = threading.Thread(target=self._watch, name="ddp-agent-lifeline", daemon=True)

    @classmethod
    def start(cls, env: dict[str, str], directory: str | None) -> _Lifeline | None:
        try:
            timeout = float(env[LIFELINE_ENV])
        except ValueError:
            return None
        if timeout <= 0:
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        life = cls(timeout, directory)
        life.relay.start()
        life.watch.start()
        return life

    def _watch(self) -> None:
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([self.stdin], [], [], 1.0)
            if ready:
                try:
                    data = os.read(self.stdin, 4096)
                except OSError as e:
                    return self._lose(f"stdin: {e}")
                if not data:
                    return self._lose("stdin closed: the launcher (or its SSH connection) is gone")
                last = time.monotonic()
            elif time.monotonic() - last > self.timeout:
                return self._lose(f"no heartbeat from the launcher for {self.timeout:g}s")

    def _lose(self, why: str) -> None:
        if self.done:
            return
        with self.lock:
            self.lost = why
            fd = _open_log(self.directory)
            old, self.out = self.out, fd
        msg = f"ddp-agent: lost the launcher ({why}); stopping the job with SIGTERM (every rank saves)\n"
        for target in (old, fd):
            with contextlib.suppress(OSError):
                os.write(target, msg.encode())
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's handler: the graceful stop of ddp-launch stop

    def _relay(self) -> None:
        while True:
            try:
                data = os.read(self.relay_in, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                try:
                    os.write(self.out, data)
                except OSError:  # the reader is gone: keep the output on the node instead
                    try:
                        self.out = _open_log(self.directory)
                        os.write(self.out, data)
                    except OSError:
                        pass

    def finish(self) -> None:
        """Stop relaying: the agent's own ends of the pipe close, the relay drains what is left."""
        self.done = True
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.out, 1)
        os.dup2(self.out, 2)
        self.relay.join(timeout=5)


def _stopped_line(signum: int, started: bool) -> tuple[int, str]:
    name = signal.Signals(signum).name
    what = "torchrun stopped its workers (each saves first)" if started else "stopped before torchrun started"
    return 128 + signum, f"ddp-agent: {name}: {what}; exit {128 + signum}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
