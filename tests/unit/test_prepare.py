"""`ddp-train prepare`: tokenizers, round trips, the val split, meta.json, bad input, bounded memory."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from ddp_train import tokenizer as tk
from ddp_train.__main__ import main as ddp_train_main
from ddp_train.data import TokenFile

WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "ran",
    "to",
    "big",
    "red",
    "house",
    "with",
    "blue",
    "door",
    "café",
    "naïve",
    "日本",
    "🚀",
]
UNICODE_TEXT = "Grüße, 日本語 — ok?\n\ttabs  and  spaces\r\nemoji 🚀 end"


def numbered_lines(n: int, seed: int, tag: str = "") -> list[str]:
    rng = random.Random(seed)
    return [f"{tag}{i:05d} " + " ".join(rng.choice(WORDS) for _ in range(6)) + ".\n" for i in range(n)]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("".join(numbered_lines(400, 1, "a")), encoding="utf-8")
    (src / "sub" / "b.md").write_text("".join(numbered_lines(300, 2, "b")), encoding="utf-8")
    records = [{"text": line.rstrip("\n"), "id": i} for i, line in enumerate(numbered_lines(200, 3, "c"))]
    (src / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (src / "ignored.csv").write_text("x,y\n", encoding="utf-8")
    return src


def prepare(*args: str) -> int:
    return ddp_train_main(["prepare", *map(str, args)])


def decoded(out: Path, split: str) -> str:
    meta = json.loads((out / "meta.json").read_text())
    ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
    info = meta["tokenizer"]  # byte, or a tokenizer.json next to the bins
    tok = tk.ByteTokenizer() if info["kind"] == "byte" else tk.load_file(out / info["file"], info["kind"])
    return tok.decode(ids.tolist())


def all_lines(corpus: Path) -> list[str]:
    lines = []
    for p in sorted(corpus.rglob("*")):
        if p.suffix in (".txt", ".md"):
            lines += p.read_text(encoding="utf-8").splitlines()
        elif p.suffix == ".jsonl":
            lines += [json.loads(x)["text"] for x in p.read_text(encoding="utf-8").splitlines()]
    return lines


def test_byte_tokenizer_round_trips():
    tok = tk.ByteTokenizer()
    ids = tok.encode(UNICODE_TEXT)
    assert ids.max() < 256 and len(ids) == len(UNICODE_TEXT.encode("utf-8"))
    assert tok.decode(ids.tolist()) == UNICODE_TEXT


def test_byte_prepare_splits_every_line_once_and_writes_meta(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    # small chunks: many chunk boundaries, some inside multi-byte characters or far from a newline
    assert prepare(corpus, "--out", out, "--workers", 1, "--chunk-bytes", 3001) == 0
    assert "train" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["tokenizer"] == {"kind": "byte"}
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "c.jsonl", "b.md"]
    for s in meta["sources"]:
        data = Path(s["path"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
    train, val = decoded(out, "train"), decoded(out, "val")
    assert meta["train_tokens"] == len(train.encode()) and meta["val_tokens"] == len(val.encode())
    train_lines, val_lines = train.splitlines(), val.splitlines()
    assert not set(train_lines) & set(val_lines), "a line is in both splits"
    assert sorted(train_lines + val_lines) == sorted(all_lines(corpus))  # every line once, none cut
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.2  # about --val-fraction 0.1
    assert {line[0] for line in val_lines} == {"a", "b", "c"}  # every file contributes to val


def test_output_does_not_depend_on_the_number_of_workers(corpus, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert prepare(corpus, "--out", one, "--workers", 1, "--chunk-bytes", 5000) == 0
    assert prepare(corpus, "--out", two, "--workers", 2, "--chunk-bytes", 5000) == 0
    for name in ("train.bin", "val.bin"):
        assert (one / name).read_bytes() == (two / name).read_bytes()


def test_held_out_file_is_the_whole_val_split(corpus, tmp_path):
    out = tmp_path / "out"
    glob = str(corpus / "**" / "*.md")
    assert prepare(corpus, "--val-file", glob, "--out", out, "--workers", 1) == 0
    assert decoded(out, "val") == (corpus / "sub" / "b.md").read_text(encoding="utf-8")
    assert "b0" not in decoded(out, "train")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["val_split"] == {"files": [str((corpus / "sub" / "b.md").resolve())]}


def test_bpe_is_trained_saved_and_round_trips(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "out"
    assert prepare(corpus, "--out", out, "--tokenizer", "bpe", "--vocab-size", 400, "--workers", 1) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["file"] == "tokenizer.json"
    assert 256 < meta["vocab_size"] <= 400 and meta["dtype"] == "uint16"
    tok = tk.load_file(out / "tokenizer.json")
    ids = tok.encode(UNICODE_TEXT)
    assert tok.decode(ids.tolist()) == UNICODE_TEXT
    assert len(tok.encode("the cat sat on a mat")) < len("the cat sat on a mat")  # it learned merges
    lines = decoded(out, "train").splitlines() + decoded(out, "val").splitlines()
    assert sorted(lines) == sorted(all_lines(corpus))
    assert meta["train_tokens"] == (out / "train.bin").stat().st_size // 2


def test_named_tokenizer_file_with_a_large_vocabulary_gives_uint32(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    vocab.update({f"filler{i}": len(vocab) + i for i in range(70_000)})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = tmp_path / "big.json"
    tok.save(str(named))
    words = tmp_path / "words.txt"
    words.write_text(" ".join(random.Random(5).choice(WORDS) for _ in range(3000)), encoding="utf-8")
    out = tmp_path / "out"
    assert prepare(words, "--out", out, "--tokenizer", named, "--workers", 1) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == len(vocab)
    assert meta["tokenizer"]["kind"] == "file" and (out / "tokenizer.json").is_file()
    ids = np.fromfile(out / "train.bin", dtype=np.uint32)
    assert ids.max() <= len(WORDS) and (ids > 0).all()  # words only, no unknowns
    ds = TokenFile(str(out / "train.bin"), 4, meta["vocab_size"], "uint32")
    x, y = ds[0]
    assert x.tolist() == ids[:4].tolist() and y.tolist() == ids[1:5].tolist()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["{src}/nope", "--out", "{out}"], "nope: SRC: no such file or folder"),
        (["{src}", "--out", "{out}", "--tokenizer", "gpt2"], "gpt2: --tokenizer: no such tokenizer file"),
        (["{src}/bad.jsonl", "--out", "{out}"], "bad.jsonl: --jsonl-field: a record in bytes 0-"),
        (["{src}/latin1.txt", "--out", "{out}"], "latin1.txt: SRC: not UTF-8 text (byte 3)"),
        (["{src}/a.txt", "--out", "{out}", "--val-fraction", "1.5"], "--val-fraction: 1.5 is not in [0, 1)"),
        (["{src}/a.txt", "--out", "{out}", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, expected):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n", encoding="utf-8")
    (src / "bad.jsonl").write_text('{"body": "no text field"}\n', encoding="utf-8")
    (src / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    argv = [a.format(src=src, out=tmp_path / "out") for a in args]
    with pytest.raises(SystemExit) if "--bogus" in argv else _nullcontext() as exit_info:
        code = ddp_train_main(["prepare", *argv])
    code = exit_info.value.code if "--bogus" in argv else code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert "Traceback" not in err
    if "gpt2" in argv:
        assert "nothing is downloaded" in err


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


RSS_PROBE = textwrap.dedent(
    """
    import resource, sys
    from ddp_train.prepare import main
    code = main(sys.argv[1:])
    # VmHWM, not ru_maxrss: after exec, RUSAGE_SELF keeps the peak of the process that forked us (pytest)
    with open("/proc/self/status") as f:
        hwm = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"rss_kib self={hwm} children={kids}")
    sys.exit(code)
    """
)


def peak_rss_kib(corpus: Path, out: Path) -> tuple[int, int]:
    """(parent, largest worker) peak RSS of `ddp-train prepare corpus --workers 2`, in KiB."""
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(corpus), "--out", str(out), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    self_kib, kids_kib = (int(x.split("=")[1]) for x in proc.stdout.split("rss_kib ")[1].split())
    return self_kib, kids_kib


@pytest.mark.slow
def test_a_corpus_larger_than_the_memory_bound_streams(tmp_path):
    """48 MiB of text through 2 workers: no process grows by more than 24 MiB over a 10-byte corpus."""
    tiny, big = tmp_path / "tiny.txt", tmp_path / "big.txt"
    tiny.write_text("tiny text\n", encoding="utf-8")
    block = "".join(numbered_lines(2000, 7)).encode("utf-8")
    with open(big, "wb") as f:
        while f.tell() < 48 << 20:
            f.write(block)
    base = peak_rss_kib(tiny, tmp_path / "tiny-out")
    peak = peak_rss_kib(big, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == big.stat().st_size
    # A few 1 MiB chunks are in flight at a time; holding the corpus would cost 48 MiB of text plus
    # 96 MiB of uint16 tokens.
    growth = [p - b for p, b in zip(peak, base)]
    assert max(growth) < 24 << 10, f"RSS growth parent/worker {growth} KiB (base {base})"


def test_progress_bar_counts_mebibytes(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("".join(numbered_lines(100000, 4)), encoding="utf-8")
    mib = -(-src.stat().st_size >> 20)
    assert mib >= 3
    assert prepare(src, "--out", tmp_path / "out", "--workers", 1, "--progress", "always") == 0
    err = capsys.readouterr().err
    draws = [d for d in err.split("\r\x1b[K") if d.startswith("[")]
    assert len(draws) == mib and draws[-1].startswith("[" + "#" * 30 + f"] {mib}/{mib} MiB"), draws[-3:]
    assert draws[0].startswith(f"[{'#' * (30 // mib)}") and f"] 1/{mib} MiB" in draws[0]


def group_processes(pgid: int) -> list[str]:
    """'pid state' of every live process in process group `pgid` (zombies count as gone)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(f"{stat.parent.name} {fields[0]}")
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
def test_a_stop_mid_run_removes_what_it_wrote_and_leaves_no_prepared_look(tmp_path, sig):
    """Ctrl-C (SIGINT to the whole foreground group, workers included) or SIGTERM while 2 workers
    encode: exit 128 + signal in one line, no *.tmp left, no meta.json (an earlier run's is removed
    first: the new bins may already have replaced the old), no process left. Was: the Pool hung for
    ever in terminate() once its workers died of the SIGINT, *.tmp and the old meta.json left."""
    big, out = tmp_path / "big.txt", tmp_path / "out"
    big.write_text("".join(numbered_lines(300, 7)), encoding="utf-8")
    assert prepare(big, "--out", out, "--workers", 1) == 0  # an earlier, complete run in DIR
    block = "".join(numbered_lines(2000, 7)).encode("utf-8")
    with open(big, "wb") as f:
        while f.tell() < 160 << 20:
            f.write(block)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddp_train.prepare",
            str(big),
            "--out",
            str(out),
            "--workers",
            "2",
            "--progress",
            "always",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        progress = ""
        while "1/" not in progress and proc.poll() is None:  # a chunk is encoded and written to DIR
            progress += proc.stderr.read(1)
        os.killpg(proc.pid, sig)
        err = progress + proc.communicate(timeout=60)[1]
        assert proc.returncode == 128 + sig, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [ln for ln in err.split("\x1b[K")[-1].splitlines() if not ln.startswith("[")]  # past the bar
    assert lines == [f"ddp-train prepare: stopped by {sig.name}: {out} holds no prepared data (no meta.json)"]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".tmp", ".json")) == []
    deadline = time.monotonic() + 10
    while group_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_processes(proc.pid) == []


def test_python_m_ddp_train_prepare_is_the_command(tmp_path):
    """`stage --help` names `python -m ddp_train.prepare`: it printed nothing and exited 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_train.prepare", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ddp-train prepare"), proc
