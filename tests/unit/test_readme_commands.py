"""Every `ddp-launch` and `ddp-train prepare` command README.md shows uses only options the command's own
parser has (what `--help` lists): a renamed or removed flag fails here, not on a newcomer's first day."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ddp_train import prepare
from ddp_train.launch.cliparse import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line number, words) of each README line that runs ddp-launch or ddp-train, continuation lines
    joined, comments dropped, optional parts' brackets removed (`[--to DIR]` -> `--to DIR`)."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    fenced, code = False, []  # code lines: indented blocks and ``` blocks (prose is not shell)
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
            code.append("")
        else:
            code.append(line if fenced or line.startswith("    ") else "")
    lines = code
    found: list[tuple[int, list[str]]] = []
    i = 0
    while i < len(lines):
        start, text = i + 1, lines[i].strip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        for part in re.split(r"\s&&\s", text):
            words = shlex.split(part.replace("[", " ").replace("]", " "), comments=True)
            while words and "/" in words[0] and not words[0].endswith(("ddp-launch", "ddp-train")):
                words = words[1:]  # .venv/bin/python ... : not ours
            if words and Path(words[0]).name in ("ddp-launch", "ddp-train"):
                found.append((start, [Path(words[0]).name, *words[1:]]))
    return found


def options_of(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def subparser(name: str):
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices[name]


def flags(words: list[str], stop_at_script: bool) -> list[str]:
    """The options among `words`: up to the user's script, `-m module` or `--` (what follows is theirs)."""
    out = []
    for w in words:
        if stop_at_script and (w.endswith(".py") or w in ("-m", "--")):
            break
        if w.startswith("-") and not re.fullmatch(r"-\d.*", w):
            out.append(w.split("=", 1)[0])
    return out


COMMANDS_SHOWN = readme_commands()


def test_readme_shows_the_commands_a_newcomer_runs() -> None:
    named = (*COMMANDS, "stage", "fetch", "restart", "prepare")
    shown = {(w[0], w[1] if len(w) > 1 and w[1] in named else "run") for _, w in COMMANDS_SHOWN}
    for needed in (("ddp-launch", "run"), ("ddp-launch", "doctor"), ("ddp-launch", "status"),
                   ("ddp-launch", "restart"), ("ddp-train", "prepare")):  # fmt: skip
        assert needed in shown, shown


@pytest.mark.parametrize(("line", "words"), COMMANDS_SHOWN, ids=[f"README:{n}" for n, _ in COMMANDS_SHOWN])
def test_every_option_readme_shows_is_one_the_command_has(line: int, words: list[str]) -> None:
    prog, args, command = words[0], words[1:], "prepare"
    if prog == "ddp-train":
        assert args[:1] == ["prepare"], f"README.md:{line}: only `ddp-train prepare` is shown: {words}"
        parser, used = prepare.build_parser(), flags(args[1:], stop_at_script=False)
    else:
        command = args[0] if args and not args[0].startswith("-") and args[0] in subcommands() else "run"
        rest = args[1:] if args[:1] == [command] else args
        parser, used = subparser(command), flags(rest, stop_at_script=command == "run")
    known = options_of(parser)
    if prog == "ddp-launch" and command == "restart":  # the options after JOB are added to the launch's
        known |= options_of(subparser("run"))
    unknown = [f for f in used if f not in known]
    assert not unknown, f"README.md:{line}: {' '.join(words)}: {unknown} not in `{prog} --help`"


def subcommands() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)
