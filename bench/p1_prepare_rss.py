"""P1: peak RSS of `ddp-train prepare` on a 1 GiB text corpus against reading it whole (nanoGPT's way).

Builds a corpus of --size-mib MiB (numbered lines of random words, in --files files) under --dir, runs
`ddp-train prepare` on it (--workers, default all cores) and the baseline `text = f.read(); ids =
encode(text)` of nanoGPT's prepare.py (byte tokenizer both, so the tokens are the same), each in its own
process, and reports every process's peak RSS (VmHWM for the parent, ru_maxrss of the workers). Last
line: `P1 prepare/read_all peak_rss ratio=<prepare total / baseline> prepare_MiB=... read_all_MiB=...`.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

PYTHON = sys.executable

PROBE = textwrap.dedent(
    """
    import resource, sys, time
    t0 = time.perf_counter()
    if sys.argv[1] == "prepare":
        from ddp_train.prepare import main
        code = main(sys.argv[2:])
    else:  # read_all: nanoGPT's data/*/prepare.py shape with the byte tokenizer
        import numpy as np
        from pathlib import Path
        n = 0
        for p in sorted(Path(sys.argv[2]).glob("*.txt")):
            text = p.read_text(encoding="utf-8")
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
            n += len(ids)
            del text, ids
        code = 0
    seconds = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        hwm = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"rss_kib self={hwm} children={kids} seconds={seconds:.2f}")
    sys.exit(code)
    """
)

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "which",
    "or",
    "be",
    "are",
]


def build_corpus(directory: Path, size_mib: int, files: int) -> int:
    """`files` text files of numbered lines, together size_mib MiB; returns the byte count."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    block = "".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) + ".\n" for _ in range(20000)
    ).encode()
    per_file = (size_mib << 20) // files
    for i in range(files):
        with open(directory / f"part{i:03d}.txt", "wb") as f:
            n = 0
            while f.tell() < per_file:
                f.write(f"{i}:{n} ".encode() + block)
                n += 1
    return sum(p.stat().st_size for p in directory.iterdir())


def probe(args: list[str]) -> dict[str, float]:
    proc = subprocess.run([PYTHON, "-c", PROBE, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"P1: {' '.join(args[:1])} failed: {proc.stderr.strip()[-2000:]}")
    print(proc.stdout.strip().splitlines()[0] if args[0] == "prepare" else "", end="")
    fields = proc.stdout.split("rss_kib ")[1].split()
    return {k: float(v) for k, v in (f.split("=") for f in fields)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the read-all baseline")
    args = ap.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ddp-bench-p1-"))
    try:
        t0 = time.perf_counter()
        size = build_corpus(scratch / "corpus", args.size_mib, args.files)
        print(
            f"corpus: {size / 2**20:.0f} MiB in {args.files} files, built in {time.perf_counter() - t0:.1f}s"
        )
        out = scratch / "out"
        ours = probe(["prepare", str(scratch / "corpus"), "--out", str(out), "--workers", str(args.workers)])
        total_kib = ours["self"] + args.workers * ours["children"]
        mib_s = size / 2**20 / ours["seconds"]
        print(
            f"\nprepare: {ours['seconds']:.1f}s ({mib_s:.0f} MiB/s), peak RSS parent "
            f"{ours['self'] / 1024:.0f} MiB, largest worker {ours['children'] / 1024:.0f} MiB, "
            f"all {args.workers + 1} processes at most {total_kib / 1024:.0f} MiB"
        )
        shutil.rmtree(out, ignore_errors=True)
        if args.no_baseline:
            ratio = total_kib * 1024 / size
            print(f"P1 prepare/corpus peak_rss ratio={ratio:.3f} prepare_MiB={total_kib / 1024:.0f}")
            return 0
        base = probe(["read_all", str(scratch / "corpus")])
        print(f"read_all: {base['seconds']:.1f}s, peak RSS {base['self'] / 1024:.0f} MiB")
        print(
            f"P1 prepare/read_all peak_rss ratio={total_kib / base['self']:.3f} "
            f"prepare_MiB={total_kib / 1024:.0f} read_all_MiB={base['self'] / 1024:.0f} "
            f"corpus_MiB={size / 2**20:.0f} prepare_s={ours['seconds']:.1f} workers={args.workers}"
        )
        return 0
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
