"""The start of every script a node runs: defines the shipped modules as a package, runs one's main.

Executed as `python -c` source (see `ddp_train.launch.node.script`), so it imports nothing of ours."""

from __future__ import annotations

import sys
import types

PACKAGE = "_ddp_node"


def run(sources: dict[str, str], main: str) -> None:
    """Execute each source (dependencies first) as module `_ddp_node.<name>`, then exit with main's code."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    sys.modules[PACKAGE] = package
    module = package
    for name, text in sources.items():
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__package__ = PACKAGE
        module.__file__ = f"ddp_train/launch/node/{name}.py"
        sys.modules[module.__name__] = module
        setattr(package, name, module)
        exec(compile(text, module.__file__, "exec"), module.__dict__)  # noqa: S102 (our own shipped files)
    sys.exit(sys.modules[f"{PACKAGE}.{main}"].main(sys.argv[1:]))
