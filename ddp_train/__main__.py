"""`ddp-train` / `python -m ddp_train`: validate the config, then train (alone or under torchrun).

Exit codes: 0 success; 2 bad input (config, --set, plug-in, data file, incompatible checkpoint) or a
disk refusing a write (full, quota, read-only, permission, I/O error);
3 ranks ended with different parameters; 143 (130) stopped by SIGTERM (SIGINT) after saving a
checkpoint; 1 any other failure.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from typing import NoReturn

from ddp_train import exitcodes
from ddp_train.cliargs import Parser
from ddp_train.config import DEFAULT_CONFIG_PATH, ConfigError, dump_yaml, load_config
from ddp_train.console import emit_line


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of the trainer."""
    p = Parser(
        prog="ddp-train",
        hint="--help",
        description="DDP trainer (`ddp-train prepare --help`: text -> token files). Run alone (one "
        "process) or under torchrun, e.g. `torchrun --standalone --nproc-per-node 2 -m ddp_train`.",
        epilog="Exit codes: 0 ok, 2 bad input or a disk refusing a write, 3 ranks diverged, 143/130 stopped "
        "by SIGTERM/SIGINT after saving a checkpoint, 1 other failures.",
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML config (default: the packaged configs/default.yaml)"
    )
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one key, value parsed as YAML (repeatable), e.g. --set train.lr=1e-3",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ddp-train`; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        from ddp_train.prepare import main as prepare_main

        return prepare_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        emit_line(f"ddp-train: error: {exc}", sys.stderr)
        return exitcodes.BAD_INPUT
    if args.print_config:
        sys.stdout.write(dump_yaml(cfg))
        return exitcodes.OK
    # torch is imported only once the config is known good; its "Failed to initialize NumPy" warning
    # (numpy is not a dependency) would otherwise be an extra stderr line in every process.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from ddp_train.trainer import run

    return run(cfg, source=args.config or str(DEFAULT_CONFIG_PATH))


def exit_now(code: int) -> NoReturn:
    """End a rank of a multi-rank run without interpreter finalization, once everything is written.
    torch 2.13, gloo + DDP: a gloo worker thread can free a finished operation after finalization
    began, needs the GIL and the C++ runtime aborts the process ("terminate called without an active
    exception", SIGABRT) after the rank finished and returned its exit code, so torchrun reports the
    job FAILED (pytorch/pytorch PR #179291; docs/launcher.md). run() has closed its files and left the
    process group by now; what is still buffered is flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def entry() -> NoReturn:
    """`ddp-train` and `python -m ddp_train`: main(), then a rank of a multi-rank run ends with exit_now
    (no WORLD_SIZE: one process, a normal exit)."""
    code = main()
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.isdigit() and int(world_size) > 1:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
