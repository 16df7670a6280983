"""The script check over a corpus of whole scripts written in the styles people publish.

Each entry of tests/scriptcheck/corpus/ is one script, or a directory whose train.py imports local
modules. Its header declares the findings a reviewer expects (`# expect: <code> <line>`, or
`<code> <file>:<line>` in another file of the entry, or `# expect: none`) and, where the backend is
written in the script, `# backend: <name>`. The check must find exactly those: precision and recall
over the whole corpus are 1.0. Run with `-s` to see the table.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

from ddp_train.launch.plan.scriptcheck import CODES, ScriptCheck, check_script

CORPUS = Path(__file__).resolve().parents[1] / "scriptcheck" / "corpus"
EXPECT = re.compile(r"^# expect: (?:none|(?P<code>[a-z-]+) (?:(?P<file>[\w/.-]+):)?(?P<line>\d+))$")
BACKEND = re.compile(r"^# backend: (\w+)$")
Key = tuple[str, str, int]  # (code, file within the entry, line)


def entries() -> list[tuple[str, Path]]:
    """(name, the script to check) for every corpus entry."""
    out = []
    for p in sorted(CORPUS.iterdir()):
        if p.is_dir():
            out.append((p.name, p / "train.py"))
        elif p.suffix == ".py":
            out.append((p.name, p))
    return out


def header(script: Path) -> tuple[set[Key], list[str]]:
    expected: set[Key] = set()
    backends: list[str] = []
    saw_expect = False
    for line in script.read_text().splitlines():
        if not line.startswith("#"):
            break
        m = EXPECT.match(line)
        if m:
            saw_expect = True
            if m.group("code"):
                expected.add((m.group("code"), m.group("file") or script.name, int(m.group("line"))))
        elif BACKEND.match(line):
            backends.append(BACKEND.match(line).group(1))  # type: ignore[union-attr]
    assert saw_expect, f"{script}: no `# expect:` line in its header"
    return expected, backends


def check_entry(script: Path) -> ScriptCheck:
    root = script.parent if script.parent != CORPUS else None
    return check_script(script, [root] if root else [])


def found_keys(script: Path, check: ScriptCheck) -> set[Key]:
    base = script.parent
    return {(f.code, Path(f.path).resolve().relative_to(base).as_posix(), f.line) for f in check.findings}


def test_corpus_precision_and_recall_are_one() -> None:
    rows, tp, n_expected, n_found, misses = [], 0, 0, 0, []
    for name, script in entries():
        expected, backends = header(script)
        check = check_entry(script)
        found = found_keys(script, check)
        hit = expected & found
        tp, n_expected, n_found = tp + len(hit), n_expected + len(expected), n_found + len(found)
        rows.append(f"{name:40} {len(expected):8} {len(found):5} {len(hit):7}")
        misses += [f"{name}: missed {k}" for k in sorted(expected - found)]
        misses += [f"{name}: extra {k}: {f}" for k in sorted(found - expected) for f in check.findings
                   if (f.code, f.line) == (k[0], k[2])]  # fmt: skip
        if [b.name for b in check.backends] != backends:
            misses.append(f"{name}: backends {[b.name for b in check.backends]}, header says {backends}")
    precision = tp / n_found if n_found else 1.0
    recall = tp / n_expected if n_expected else 1.0
    print("\nentry                                    expected found correct")
    print("\n".join(rows))
    print(f"{len(rows)} entries: {n_expected} expected, {n_found} found, {tp} correct; "
          f"precision {precision:.2f}, recall {recall:.2f}")  # fmt: skip
    assert not misses, "\n".join(misses)
    assert precision == 1.0 and recall == 1.0


def test_the_corpus_is_big_varied_and_half_clean() -> None:
    """At least 30 whole scripts; every script-level code expected somewhere; correct scripts too."""
    all_entries = entries()
    assert len(all_entries) >= 30
    expectations = [header(script)[0] for _, script in all_entries]
    codes = {k[0] for e in expectations for k in e}
    assert codes == set(CODES) - {"backend", "syntax"}, codes
    clean = sum(1 for e in expectations if not e)
    assert clean >= 12, f"only {clean} correct scripts"
    lengths = [len(script.read_text().splitlines()) for _, script in all_entries]
    assert min(lengths) >= 25 and sum(lengths) / len(lengths) >= 45  # whole scripts, not snippets


def test_the_seed_script_gets_both_of_its_mistakes(capsys: pytest.CaptureFixture) -> None:
    script = CORPUS / "11_seed_howto" / "train.py"
    check = check_entry(script)
    init, gpu = check.findings
    text = script.read_text().splitlines()
    assert init.code == "init-args" and "init_process_group(" in text[init.line - 1]
    assert gpu.code == "cuda-device" and text[gpu.line - 1].strip() == "model.cuda()"
    assert "torch.cuda.current_device() at " in gpu.message and "does not choose one" in gpu.message
    fixed = check_entry(CORPUS / "12_seed_fixed" / "train.py")
    assert fixed.findings == ()


def test_the_corpus_is_checked_in_under_2s_and_at_most_4x_parsing_it() -> None:
    """Baseline in the same run: reading and parsing the same files with ast.parse, the least any
    ast-based check must do. CPU time of this process, best of 7 of each, interleaved, so that other
    work on a shared machine slows neither side more than the other; the wall time of the check
    must stay under 2 s."""
    files = sorted(CORPUS.rglob("*.py"))
    scripts = [s for _, s in entries()]
    parse, took, wall = [], [], []
    for _ in range(7):
        start = time.process_time()
        for path in files:
            ast.parse(path.read_text(), str(path))
        parse.append(time.process_time() - start)
        start, start_wall = time.process_time(), time.perf_counter()
        for script in scripts:
            check_entry(script)
        took.append(time.process_time() - start)
        wall.append(time.perf_counter() - start_wall)
    ratio = min(took) / min(parse)
    print(f"\n{len(files)} files: check {min(took) * 1000:.1f} ms CPU ({min(wall) * 1000:.1f} ms wall), "
          f"ast.parse {min(parse) * 1000:.1f} ms CPU, ratio {ratio:.2f}")  # fmt: skip
    assert min(wall) < 2.0 and ratio <= 4.0, f"check {min(took):.3f}s, parse {min(parse):.3f}s"


@pytest.mark.parametrize(
    ("entry", "code", "says"),
    [
        ("03_tutorial_multinode_local_rank.py", "save-rank", ["self.local_rank, a rank within the node",
                                                              "once per node", "shared filesystem"]),
        ("28_save_every_rank.py", "save-rank", ["runs on every rank"]),
        ("05_imagenet_style_spawn.py", "init-args", ["'tcp://224.66.41.62:23456'", "--dist-url at line 39",
                                                     "makes --dist-url unnecessary"]),
        ("05_imagenet_style_spawn.py", "save-rank", ["args.rank % ngpus_per_node", "once per node"]),
        ("01_tutorial_spawn_multigpu.py", "spawn", ["mp.spawn(main, ...)", "drop the spawn",
                                                    "read LOCAL_RANK, RANK and WORLD_SIZE"]),
        ("01_tutorial_spawn_multigpu.py", "init-args", ["rank=rank", "the spawn's process index"]),
        ("21_mp_process_gloo.py", "env-set", ["os.environ['MASTER_ADDR'] = '127.0.0.1'", "delete the line"]),
        ("24_world_size_device_count.py", "init-args", ["world_size=num_gpus",
                                                        "this node's GPUs, not the job's processes"]),
        ("08_module_constants.py", "init-args", ["init_method=MASTER_URL (= 'tcp://10.1.0.5:23456')"]),
        ("30_fixed_gpu_constant.py", "cuda-device", [".cuda(GPU) with GPU = 0 names a fixed GPU"]),
        ("11_seed_howto/train.py", "cuda-device", ["model.cuda() uses CUDA",
                                                   "torch.cuda.current_device() at "]),
    ],
)  # fmt: skip
def test_each_message_says_what_really_happens(entry: str, code: str, says: list[str]) -> None:
    """The value that made the finding, where it came from, and the consequence in words."""
    messages = [f.message for f in check_entry(CORPUS / entry).findings if f.code == code]
    assert messages and all(any(s in m for m in messages) for s in says), messages


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"train.py": "import torch.distributed as dist\nimport sys\nif sys.argv[1:]:\n"
                      "    url = 'tcp://10.0.0.1:1234'\nelse:\n    url = 'env://'\n"
                      "dist.init_process_group('gloo', init_method=url)\n"}, []),
        ({"train.py": "import torch.distributed as dist\nfrom config import URL\n"
                      "dist.init_process_group('gloo', init_method=URL)\n",
          "config.py": "URL = 'tcp://10.0.0.1:1234'\n"}, []),
        ({"train.py": "import os\nimport torch.distributed as dist\nimport torch.multiprocessing as mp\n\n\n"
                      "def worker(rank, n):\n    rank = int(os.environ.get('RANK', rank))\n"
                      "    ws = int(os.environ['WORLD_SIZE'])\n"
                      "    dist.init_process_group('gloo', rank=rank, world_size=ws)\n\n\n"
                      "mp.spawn(worker, args=(2,), nprocs=2)\n"}, [("spawn", 12)]),
        ({"train.py": "import torch.distributed as dist\nURL = 'tcp://10.0.0.1:1234'\n\n\ndef setup():\n"
                      "    url = URL\n    dist.init_process_group('gloo', init_method=url)\n"},
         [("init-args", 7)]),
    ],
    ids=["assigned-twice", "other-module", "parameter-reassigned", "chain-to-module-constant"],
)  # fmt: skip
def test_what_the_values_are_followed_through(files: dict[str, str], expected: list, tmp_path: Path) -> None:
    """One-assignment chains and module constants are followed; a name with two values, another
    module's constant and a parameter the function overwrites are not (no finding, never a guess)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    check = check_script(tmp_path / "train.py")
    assert [(f.code, f.line) for f in check.findings] == expected, [str(f) for f in check.findings]
