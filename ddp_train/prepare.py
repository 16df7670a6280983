"""`ddp-train prepare SRC... --out DIR`: text files -> DIR/train.bin, DIR/val.bin and DIR/meta.json.

Files are cut into fixed chunks of bytes (moved to the next newline, or at least to a UTF-8 character
boundary), so memory stays bounded whatever the corpus size and the output does not depend on the number
of worker processes. The val split is deterministic: the tail `--val-fraction` of every chunk (from a
newline on), or whole held-out files (`--val-file`); the two never share a byte of the source.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddp_train import exitcodes, workerproc
from ddp_train import tokenizer as tokenizers_
from ddp_train.cliargs import Parser
from ddp_train.config import ConfigError
from ddp_train.console import emit_line
from ddp_train.digest import file_sha256
from ddp_train.metrics import ProgressBar

META_FORMAT = "ddp-train-tokens/1"
SUFFIXES = {".txt": "text", ".md": "text", ".jsonl": "jsonl"}
CHUNK_BYTES = 1 << 20
_BOUNDARY_SCAN = 4096  # look this far for a newline before cutting a text file at a character boundary


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, end) of one source file (before moving both ends to a boundary)."""

    path: str
    kind: str  # "text" | "jsonl"
    start: int
    end: int
    size: int
    val: bool  # a held-out file: all of it goes to val


# --- sources ------------------------------------------------------------------------------------------


def find_sources(specs: list[str]) -> list[Path]:
    """Files named, found under folders (recursively) or matched by globs; .txt/.md/.jsonl; sorted, unique."""
    found: set[Path] = set()
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_dir():
            hits = [q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in SUFFIXES]
            if not hits:
                raise ConfigError(spec, "SRC", f"folder holds no {'/'.join(SUFFIXES)} files")
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise ConfigError(spec, "SRC", f"unsupported file type (known: {', '.join(SUFFIXES)})")
            hits = [p]
        else:
            hits = [Path(q) for q in glob.glob(str(p), recursive=True)]
            hits = [q for q in hits if q.is_file() and q.suffix.lower() in SUFFIXES]
            if not hits:
                raise ConfigError(spec, "SRC", "no such file or folder, and no .txt/.md/.jsonl file matches")
        found.update(q.resolve() for q in hits)
    return sorted(found)


def plan_chunks(paths: list[Path], val_paths: set[Path], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Every file cut into chunk_bytes pieces, in order."""
    out = []
    for p in paths:
        size = p.stat().st_size
        kind = SUFFIXES[p.suffix.lower()]
        for start in range(0, size, chunk_bytes):
            out.append(Chunk(str(p), kind, start, min(start + chunk_bytes, size), size, p in val_paths))
    return out


# --- reading a chunk ----------------------------------------------------------------------------------


def _boundary(f: Any, pos: int, size: int, kind: str) -> int:
    """Where a chunk that nominally starts at `pos` really starts: after the next newline (jsonl: always;
    text: if one is within 4 KiB), else at the next UTF-8 character start. Same answer for both neighbours."""
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    f.seek(pos - 1)
    scanned = 0
    while True:
        block = f.read(_BOUNDARY_SCAN)
        if not block:
            return size
        nl = block.find(b"\n")
        if nl >= 0:
            return pos - 1 + scanned + nl + 1
        scanned += len(block)
        if kind == "text" and scanned >= _BOUNDARY_SCAN:
            break
    f.seek(pos)
    head = f.read(4)
    skip = 0
    while skip < len(head) and 0x80 <= head[skip] < 0xC0:
        skip += 1
    return pos + skip


def read_chunk(c: Chunk) -> str:
    """The chunk's text (jsonl: each record's field, one per line once the caller has parsed it)."""
    with open(c.path, "rb") as f:
        start = _boundary(f, c.start, c.size, c.kind)
        end = _boundary(f, c.end, c.size, c.kind)
        if end <= start:
            return ""
        f.seek(start)
        data = f.read(end - start)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(c.path, "SRC", f"not UTF-8 text (byte {start + exc.start})") from None


def jsonl_texts(text: str, c: Chunk, field: str) -> str:
    """The `field` of every record in a jsonl chunk, each followed by a newline."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            where = f"bytes {c.start}-{c.end}"
            raise ConfigError(c.path, "SRC", f"invalid JSON line in {where}: {exc.msg}") from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise ConfigError(
                c.path, "--jsonl-field", f"a record in bytes {c.start}-{c.end} has no string field {field!r}"
            )
        out.append(value + "\n")
    return "".join(out)


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """(train, val): val is the tail `val_fraction` of the text, starting after a newline when one follows."""
    if val_fraction <= 0 or not text:
        return text, ""
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.find("\n", cut)
    if 0 <= nl < len(text) - 1:
        cut = nl + 1
    return text[:cut], text[cut:]


def chunk_parts(c: Chunk, val_fraction: float, field: str) -> tuple[str, str]:
    """A chunk's (train text, val text)."""
    text = read_chunk(c)
    if c.kind == "jsonl":
        text = jsonl_texts(text, c, field)
    if c.val:
        return "", text
    return split_text(text, val_fraction)


# --- workers ------------------------------------------------------------------------------------------

_TOK: Any = None


def _load_tokenizer(spec: dict[str, str]) -> None:
    global _TOK
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _TOK = open_tokenizer(spec)


def _init_worker(spec: dict[str, str], parent_pid: int) -> None:
    # Ctrl-C and a SIGTERM to the process group reach every worker: the parent alone stops the run and
    # removes what it wrote; a worker gone first would break the pool under it (workerproc.py)
    workerproc.leave_stops_to(parent_pid)
    _load_tokenizer(spec)


def open_tokenizer(spec: dict[str, str]) -> tokenizers_.Tokenizer:
    """The tokenizer of a spec: {'kind': 'byte'} or {'kind': ..., 'path': tokenizer.json}."""
    if spec["kind"] == "byte":
        return tokenizers_.ByteTokenizer()
    return tokenizers_.load_file(spec["path"], spec["kind"])


def _encode(args: tuple[Chunk, float, str, str]) -> tuple[Any, ...]:
    c, val_fraction, field, dtype = args
    try:
        train, val = chunk_parts(c, val_fraction, field)
    except ConfigError as exc:  # sent back as plain data: the parent raises it again
        return ("error", exc.source, exc.field, exc.message)
    return _TOK.encode(train).astype(dtype), _TOK.encode(val).astype(dtype), c.end - c.start


def _encoded(tasks: list[tuple[Chunk, float, str, str]], spec: dict[str, str], workers: int) -> Iterator[Any]:
    """Encoded chunks in order; at most 2 x workers in flight, so memory is bounded. Closing the generator
    (a stop, an error) drops the chunks not yet started and waits for the running ones (~1 s: a chunk).

    A ProcessPoolExecutor, not multiprocessing.Pool: a Pool whose worker was killed while holding its
    task queue's lock hangs for ever in terminate() (seen: `kill -INT` to the process group); the
    executor marks itself broken instead (CPython 3.11 concurrent/futures/process.py)."""
    if workers <= 1:
        _load_tokenizer(spec)
        yield from map(_encode, tasks)
        return
    ctx = multiprocessing.get_context("spawn")  # the parent may hold tokenizers' threads: no fork
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(spec, os.getpid())
    )
    try:
        pending: collections.deque = collections.deque()
        for task in tasks:
            with workerproc.stops_held():  # a submit may start a worker: it must not die of a stop
                pending.append(pool.submit(_encode, task))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --- the command --------------------------------------------------------------------------------------


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def prepare(
    sources: list[str],
    out: Path,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    val_fraction: float = 0.1,
    val_files: list[str] | None = None,
    jsonl_field: str = "text",
    workers: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize `sources` into out/train.bin and out/val.bin; write and return out/meta.json's contents."""
    t0 = time.perf_counter()
    held_out = find_sources(val_files) if val_files else []
    if held_out:
        val_fraction = 0.0
    train_paths = [p for p in find_sources(sources) if p not in set(held_out)]
    if not train_paths:
        raise ConfigError(" ".join(sources), "SRC", "every source is a --val-file; nothing left to train on")
    paths = train_paths + held_out
    chunks = plan_chunks(paths, set(held_out), chunk_bytes)
    out.mkdir(parents=True, exist_ok=True)
    # meta.json is removed before anything in DIR changes and written last: a directory without it is
    # not a prepared one (the trainer says so), whatever a stop or an error left of the other files
    (out / "meta.json").unlink(missing_ok=True)
    field = jsonl_field

    if tokenizer == "byte":
        spec, tok = {"kind": "byte"}, tokenizers_.ByteTokenizer()
    elif tokenizer == "bpe":
        texts = (chunk_parts(c, val_fraction, field)[0] for c in chunks if not c.val)
        tok = tokenizers_.train_bpe(texts, vocab_size, out / tokenizers_.BPE_FILE)
        _check_stop()  # training is native code: a stop during it is seen here
        spec = {"kind": "bpe", "path": str(out / tokenizers_.BPE_FILE)}
    else:
        named = tokenizers_.load_file(tokenizer)
        dest = out / tokenizers_.BPE_FILE
        if named.path != dest.resolve():
            shutil.copyfile(named.path, dest.with_name(dest.name + ".tmp"))
            os.replace(dest.with_name(dest.name + ".tmp"), dest)
        tok = tokenizers_.load_file(dest, "file")
        spec = {"kind": "file", "path": str(dest)}
    dtype = _dtype(tok.vocab_size)

    total_bytes = sum(c.end - c.start for c in chunks)
    bar = ProgressBar(max(1, -(-total_bytes >> 20)), progress)  # MiB, rounded up
    n_workers = workers or os.cpu_count() or 1
    counts = {"train": 0, "val": 0}
    tmp = {k: out / f"{k}.bin.tmp" for k in counts}
    done = 0
    try:
        tasks = [(c, val_fraction, field, dtype.name) for c in chunks]
        with (
            open(tmp["train"], "wb") as ftrain,
            open(tmp["val"], "wb") as fval,
            contextlib.closing(_encoded(tasks, spec, n_workers)) as results,
        ):
            for result in results:
                _check_stop()
                if isinstance(result[0], str):
                    raise ConfigError(*result[1:])
                train_ids, val_ids, nbytes = result
                ftrain.write(memoryview(train_ids))
                fval.write(memoryview(val_ids))
                counts["train"] += len(train_ids)
                counts["val"] += len(val_ids)
                done += nbytes
                bar.update(-(-done >> 20), f"MiB, {counts['train'] + counts['val']} tokens")
            for f in (ftrain, fval):
                f.flush()
                os.fsync(f.fileno())
        for k in counts:
            if counts[k] == 0:
                raise ConfigError(str(out), f"{k}.bin", f"no {k} tokens; use more text or another val split")
            os.replace(tmp[k], out / f"{k}.bin")
    finally:
        bar.close()
        for p in tmp.values():
            p.unlink(missing_ok=True)
    meta = {
        "format": META_FORMAT,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.describe(),
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "val_split": {"files": [str(p) for p in held_out]} if held_out else {"fraction": val_fraction},
        "chunk_bytes": chunk_bytes,
        "sources": [
            {"path": str(p), "bytes": p.stat().st_size, "sha256": file_sha256(p), "split": split}
            for p, split in [(p, "train+val" if val_fraction else "train") for p in train_paths]
            + [(p, "val") for p in held_out]
        ],
        "seconds": round(time.perf_counter() - t0, 3),
    }
    _check_stop()  # hashing a large corpus takes a while
    _write_json(out / "meta.json", meta)
    return meta


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of `ddp-train prepare`."""
    p = Parser(
        prog="ddp-train prepare",
        hint="--help",
        description="Tokenize text (.txt, .md, .jsonl files, folders, globs) into DIR/train.bin, "
        "DIR/val.bin (uint16, or uint32 for vocabularies over 65536) and DIR/meta.json for the trainer "
        "(data.name=tokens, data.tokens.path=DIR).",
    )
    p.add_argument("sources", nargs="+", metavar="SRC", help="file, folder (searched recursively) or glob")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|bpe|FILE",
        help="byte: UTF-8 bytes (vocab 256); bpe: a byte-level BPE trained on the train split and saved "
        "as DIR/tokenizer.json; FILE: a Hugging Face tokenizer.json on disk (copied to DIR). "
        "bpe and FILE need Hugging Face tokenizers (install.sh installs it: --with bpe, the default)",
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    p.add_argument(
        "--val-fraction", type=float, default=0.1, help="tail fraction of every chunk for val (default 0.1)"
    )
    p.add_argument(
        "--val-file", action="append", default=[], metavar="SRC", help="hold out these files as val instead"
    )
    p.add_argument("--jsonl-field", default="text", help="field of each .jsonl record to use (default text)")
    p.add_argument("--workers", type=int, default=0, help="processes (default: all cores)")
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help=argparse.SUPPRESS)
    p.add_argument("--progress", choices=["auto", "always", "never"], default="auto", help="progress bar")
    return p


class Stopped(Exception):
    """SIGTERM or SIGINT while preparing, raised at the next chunk (never from inside the signal handler:
    an exception thrown into the executor's or a file's code while it holds a lock would hang the
    cleanup that follows)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # the stop signal, once one came


def _stop(signum: int, _frame: Any) -> None:
    _received.append(signum)
    for sig in workerproc.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)  # a second signal ends the process at once


def _check_stop() -> None:
    if _received:
        raise Stopped(_received[0])


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ddp-train prepare`; returns the exit code."""
    args = build_parser().parse_args(argv)
    _received.clear()
    previous = {sig: signal.signal(sig, _stop) for sig in workerproc.STOP_SIGNALS}
    try:
        return _main(args)
    except Stopped as exc:
        name = signal.Signals(exc.signum).name
        emit_line(
            f"ddp-train prepare: stopped by {name}: {args.out} holds no prepared data (no meta.json)",
            sys.stderr,
        )
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(args: argparse.Namespace) -> int:
    try:
        if not 0.0 <= args.val_fraction < 1.0:
            raise ConfigError("prepare", "--val-fraction", f"{args.val_fraction} is not in [0, 1)")
        if args.val_fraction == 0 and not args.val_file:
            raise ConfigError("prepare", "--val-fraction", "0 leaves no val split; give --val-file instead")
        if not 2 <= args.vocab_size <= 1 << 24:
            raise ConfigError("prepare", "--vocab-size", f"{args.vocab_size} is not in [2, 16777216]")
        if args.workers < 0 or args.chunk_bytes < 1:
            raise ConfigError("prepare", "--workers", "must be >= 0")
        show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
        meta = prepare(
            args.sources,
            Path(args.out),
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            val_files=args.val_file,
            jsonl_field=args.jsonl_field,
            workers=args.workers,
            chunk_bytes=args.chunk_bytes,
            progress=show,
        )
    except ConfigError as exc:
        emit_line(f"ddp-train prepare: error: {exc}", sys.stderr)
        return exitcodes.BAD_INPUT
    except OSError as exc:
        where = exc.filename or args.out
        emit_line(f"ddp-train prepare: error: {where}: {exc.strerror or exc}", sys.stderr)
        return exitcodes.BAD_INPUT
    except BrokenProcessPool:  # a worker killed from outside (the OOM killer, a kill of its own pid)
        emit_line(
            f"ddp-train prepare: error: a worker process died; {args.out} holds no prepared data", sys.stderr
        )
        return exitcodes.FAILURE
    emit_line(
        f"ddp-train prepare: {args.out}: train {meta['train_tokens']} tokens, val {meta['val_tokens']} "
        f"tokens, vocab {meta['vocab_size']} ({meta['tokenizer']['kind']}), {meta['dtype']}, "
        f"{len(meta['sources'])} file(s), {meta['seconds']:.1f}s"
    )
    return exitcodes.OK


if __name__ == "__main__":  # `python -m ddp_train.prepare`, the same as `ddp-train prepare`
    sys.exit(main())
