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

Only the standard library is imported before torchrun runs (torch comes with torchrun's script).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys

ENV_LINE_LIMIT = 1 << 20  # one JSON object, the job's environment


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
    except (ValueError, UnicodeDecodeError) as e:
        print(f"ddp-agent: error: stdin: {e}", file=sys.stderr)
        return 2
    except _Stopped as e:
        return _stopped_line(e.signum, started=False)
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)  # workers must not hold the launcher's stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    torchrun = argv[0]
    sys.argv = list(argv)
    try:
        runpy.run_path(torchrun, run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except _Stopped as e:
        return _stopped_line(e.signum, started=False)
    except Exception as e:
        sigval = getattr(e, "sigval", None)  # torch.distributed.elastic's SignalException
        if type(e).__name__ != "SignalException" or sigval is None:
            raise
        return _stopped_line(int(sigval), started=True)
    return 0


def _stopped_line(signum: int, started: bool) -> int:
    name = signal.Signals(signum).name
    what = "torchrun stopped its workers (each saves first)" if started else "stopped before torchrun started"
    print(f"ddp-agent: {name}: {what}; exit {128 + signum}", flush=True)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
