"""README.md's steps run as shown (issue #48): each command of a console script pyproject.toml defines
names a subcommand that exists, and each option it passes is in that subcommand's `--help` output;
each `ansible-playbook PLAYBOOK`, `bash SCRIPT` and `./SCRIPT` names a file of the repository, and a
script's options are ones it parses; the steps are numbered from 0 and end with a detached job."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
SHELL_CODE = {"", "sh", "bash", "shell", "console"}  # fenced blocks of another language are not commands


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of README's shell code: indented blocks and shell fences, continuation lines
    joined; and each inline `code span` of prose that starts with a console script or ./SCRIPT."""
    lines = text.splitlines()
    out: list[tuple[int, str]] = []
    fence: str | None = None
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        i += 1
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if (fence is not None and fence in SHELL_CODE) or (fence is None and line.startswith("    ")):
            while line.endswith("\\") and i < len(lines):
                line, i = line[:-1] + " " + lines[i], i + 1
            out.append((start, line.strip()))
        elif fence is None:
            for span in re.findall(r"`([^`]+)`", line):
                first = span.split(" ", 1)[0]
                if (first in SCRIPTS or first.startswith("./")) and " " in span:
                    out.append((start, span))
    return out


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, words) of every command in the code lines, as the shell splits them (comments
    dropped, split at `&&`, `||`, `;` and pipes, redirections and leading VAR=value dropped); an optional
    part's brackets are removed (`[--to DIR]` -> `--to DIR`, `[best|last]` -> `best last`)."""
    found = []
    for n, line in code_lines(text):
        line = re.sub(r"\[([^\]]*)\]", lambda m: " " + m.group(1).replace("|", " ") + " ", line)
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError:  # not shell (an unbalanced quote in a sample of output)
            continue
        words: list[str] = []
        for tok in [*tokens, ";"]:
            if tok and set(tok) <= set(";&|"):
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    words = words[1:]
                if words:
                    found.append((n, words))
                words = []
            elif words[-1:] and set(words[-1]) <= set("<>"):
                words.pop()  # `> FILE`: neither word is the command's
            else:
                words.append(tok)
    return found


COMMANDS = commands(README)
CLI = [(n, w) for n, w in COMMANDS if Path(w[0]).name in SCRIPTS]


@functools.cache
def help_text(prog: str, sub: str | None) -> str:
    """`prog [sub] --help` of the console script as pip installed it (beside this Python), else its entry
    point run the same way."""
    argv = [*([sub] if sub else []), "--help"]
    exe = Path(sys.executable).parent / prog
    if exe.exists():
        cmd = [str(exe), *argv]
    else:
        module, func = SCRIPTS[prog].split(":")
        code = f"import sys; sys.argv[0] = {prog!r}; from {module} import {func}; sys.exit({func}())"
        cmd = [sys.executable, "-c", code, *argv]
    env = {**os.environ, "COLUMNS": "1000"}  # one option per line: nothing wrapped
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert res.returncode == 0, f"{' '.join(cmd)}: exit {res.returncode}: {res.stderr[-1000:]}"
    return res.stdout


def subcommand(prog: str, words: list[str]) -> str | None:
    """The subcommand the words name (None: the program's default command). A word is tried as one only
    where `prog --help` names `prog WORD`: `ddp-launch WORD --help` of any other word would launch WORD as
    a script."""
    if not words or not re.fullmatch(r"[a-z][a-z0-9-]*", words[0]):
        return None
    word = words[0]
    named = re.search(rf"{prog} \[?{word}\b", help_text(prog, None))
    assert named, f"`{prog} --help` names no `{prog} {word}`"
    usage = help_text(prog, word).lstrip().split("\n", 1)[0]
    assert re.match(rf"usage: {prog} \[?{word}\b", usage), f"`{prog} {word}`: no such subcommand ({usage})"
    return word


def options(words: list[str]) -> list[str]:
    """The options among the words, up to what belongs to the user's script: `-m MODULE`, a `*.py`
    script or `--` end them."""
    out = []
    for w in words:
        if w == "--" or w.endswith(".py"):
            break
        if w.startswith("-") and not re.fullmatch(r"-\d.*", w):
            out.append(w.split("=", 1)[0])
        if w == "-m":
            break
    return out


def in_help(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_readme_shows_commands_of_each_kind() -> None:
    progs = {Path(w[0]).name for _, w in CLI}
    assert {"ddp-launch", "ddp-train"} <= progs, progs
    assert any(w[0] == "ansible-playbook" for _, w in COMMANDS)


@pytest.mark.parametrize(("line", "words"), CLI, ids=[f"README:{n}" for n, _ in CLI])
def test_each_subcommand_exists_and_each_option_is_in_its_help(line: int, words: list[str]) -> None:
    prog = Path(words[0]).name
    sub = subcommand(prog, words[1:])
    text = help_text(prog, sub)
    if prog == "ddp-launch" and sub == "restart":  # options after JOB are the launch's (restart --help)
        text += help_text(prog, None)
    unknown = [f for f in options(words[2:] if sub else words[1:]) if not in_help(f, text)]
    shown = " ".join(filter(None, (prog, sub)))
    assert not unknown, f"README.md:{line}: {' '.join(words)}: {unknown} not in `{shown} --help`"


def test_playbooks_scripts_and_paths_shown_exist() -> None:
    missing = []
    for n, words in COMMANDS:
        named: list[str] = []
        if words[0] == "ansible-playbook":
            named += [w for w in words[1:] if w.endswith((".yml", ".yaml")) and not w.startswith("@")]
        if words[0] == "bash" and len(words) > 1:
            named.append(words[1])
        if words[0].startswith("./"):
            named.append(words[0])
        for opt, value in zip(words, words[1:], strict=False):
            if opt in ("-i", "--hosts", "--config") and "," not in value:
                named.append(value)
        missing += [f"README.md:{n}: {p}" for p in named if not (REPO / p).exists()]
    assert not missing, missing


def test_options_given_to_a_repository_script_are_ones_it_parses() -> None:
    unknown = []
    for n, words in COMMANDS:
        script = REPO / (words[1] if words[0] == "bash" and len(words) > 1 else words[0])
        if not script.is_file() or not script.read_bytes().startswith(b"#!/usr/bin/env bash"):
            continue  # not one of the repository's shell scripts (.venv/bin/python, ssh-keyscan)
        source = script.read_text(encoding="utf-8")  # its `case` on the arguments names each option
        given = options(words[2:] if words[0] == "bash" else words[1:])
        unknown += [f"README.md:{n}: {' '.join(words)}: {f}" for f in given if not in_help(f, source)]
    assert not unknown, unknown


def test_steps_go_from_a_bare_controller_to_a_detached_job() -> None:
    headings = re.findall(r"^## (.+)$", README, re.M)
    numbers = [int(m.group(1)) for h in headings if (m := re.match(r"(\d+)\. ", h))]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 6, headings
    assert re.match(r"0\. ", headings[0]), f"README's first section is not step 0: {headings[0]}"
    steps = re.split(r"^## \d+\. ", README, flags=re.M)[1:]
    provision = next(s for s in steps if "ansible-playbook site.yml" in s)
    assert "ansible-playbook playbooks/cluster_monitor.yml" in provision  # --detach needs the monitor's key
    last = steps[-1].split("\n## ", 1)[0]
    shown = [" ".join(w) for n, w in commands(last)]
    assert any(c.startswith("ddp-launch") and "--detach" in c for c in shown), shown
    for job in ("status", "attach", "stop"):
        assert any(c.startswith(f"ddp-launch {job} JOB") for c in shown), (job, shown)
