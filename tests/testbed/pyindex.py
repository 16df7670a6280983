"""Package indexes shaped like PyTorch's and PyPI's, for the pytorch role's tests (served over HTTP).

`build(root, ...)` writes two PEP 503 "simple" trees under root: `whl/` as download.pytorch.org/whl/<flavour>
serves it and `simple/` as PyPI does. Both give every file its PEP 658 metadata (`data-dist-info-metadata`
and `<file>.metadata`), as both real indexes do, and PyTorch's keeps the project names its files and
METADATA spell unnormalised (`typing_extensions`, `Jinja2`, `MarkupSafe`): pip before 23.2 compares that
raw METADATA name with the requirement's spelling (`typing-extensions`, `jinja2`) and rejects the wheel
(pip's prepare.py, fixed by pypa/pip#12044 for 23.2). The torch stub requires what the real torch requires
(the Requires-Dist of the torch installed here, markers evaluated for the nodes), each served as a small
stand-in wheel.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

# As PyTorch's index spells these projects in its file names (and their METADATA Name).
PYTORCH_SPELLING = {"typing-extensions": "typing_extensions", "jinja2": "Jinja2", "markupsafe": "MarkupSafe"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Dist:
    name: str  # as the file and METADATA spell it
    version: str
    requires: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


def wheel(dest: Path, dist: Dist) -> Path:
    """A pure-Python wheel of `dist` in dest."""
    info = f"{dist.name}-{dist.version}.dist-info"
    files = dict(dist.files)
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist.name}\nVersion: {dist.version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in dist.requires)
    )
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / f"{dist.name}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return whl


def torch_requirements(python: str = "3.11") -> list[str]:
    """The installed torch's Requires-Dist that apply on a Linux x86_64 node with that Python."""
    from packaging.requirements import Requirement

    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }
    out = []
    for r in metadata.requires("torch") or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            out.append(str(req))
    return out


def torch_stub(version: str, cuda: str | None, requires: list[str]) -> Dist:
    """torch <version>: __version__ and version.cuda, nothing else, with the given requirements."""
    return Dist(
        "torch",
        version,
        requires,
        {
            "torch/__init__.py": f'__version__ = "{version}"\nfrom . import version  # noqa\n',
            "torch/version.py": f"cuda = {cuda!r}\n",
        },
    )


def stand_ins(requires: list[str], version_of: dict[str, str] | None = None) -> list[Dist]:
    """One stand-in wheel per requirement, at a version it accepts, spelt as PyTorch's index spells it."""
    from packaging.requirements import Requirement

    version_of = version_of or {}
    out = []
    for r in requires:
        req = Requirement(r)
        key = normalise(req.name)
        version = version_of.get(key) or _lowest_allowed(req)
        name = PYTORCH_SPELLING.get(key, req.name)
        out.append(Dist(name, version, files={f"{key.replace('-', '_')}_stub.py": "STUB = True\n"}))
    return out


def _lowest_allowed(req) -> str:
    for spec in req.specifier:
        if spec.operator in (">=", "==", "~="):
            return spec.version
    return "1.0"


def write_simple(tree: Path, wheels: list[Path]) -> None:
    """A PEP 503 tree of the given wheel files, one directory per normalised name, with PEP 658 metadata."""
    by_project: dict[str, list[Path]] = {}
    for w in wheels:
        by_project.setdefault(normalise(w.name.split("-")[0]), []).append(w)
    for project, files in by_project.items():
        d = tree / project
        d.mkdir(parents=True, exist_ok=True)
        links = []
        for w in sorted(files):
            target = d / w.name
            if w != target:
                target.write_bytes(w.read_bytes())
            with zipfile.ZipFile(target) as z:
                meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
            (d / f"{w.name}.metadata").write_bytes(meta)
            sha = hashlib.sha256(target.read_bytes()).hexdigest()
            msha = hashlib.sha256(meta).hexdigest()
            links.append(
                f'<a href="{w.name}#sha256={sha}" data-dist-info-metadata="sha256={msha}" '
                f'data-core-metadata="sha256={msha}">{w.name}</a><br/>'
            )
        page = "<!DOCTYPE html>\n<html><body>\n" + "\n".join(links) + "\n</body></html>\n"
        (d / "index.html").write_text(page)
    names = sorted(p.name for p in tree.iterdir() if p.is_dir())
    (tree / "index.html").write_text("".join(f'<a href="{n}/">{n}</a><br/>\n' for n in names))
