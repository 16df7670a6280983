"""`package.module:function` plug-ins for a user's own model or dataset."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from ddp_train.config import ConfigError


def load_callable(field: str, ref: str) -> Callable[..., Any]:
    """Import `package.module:function`; the current directory is searched after installed packages."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("config", field, f"{ref!r} is not a 'package.module:function' reference")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("config", field, f"cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError("config", field, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError("config", field, f"{ref} is a {type(fn).__name__}, not a function")
    return fn


def call_plugin(field: str, ref: str, kwargs: dict[str, Any]) -> Any:
    """Load and call a plug-in with keyword arguments, refusing arguments it does not accept."""
    fn = load_callable(field, ref)
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        args_field = field.rsplit(".", 1)[0] + ".plugin_args"
        raise ConfigError("config", args_field, f"do not fit {ref}: {exc}") from None
    except ValueError:
        pass  # no introspectable signature (builtins): let the call itself decide
    return fn(**kwargs)
