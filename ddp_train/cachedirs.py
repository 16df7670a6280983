"""torch.compile's caches in directories nobody but this user can write (issue #44).

Inductor writes the Python modules and shared objects it generates under TORCHINDUCTOR_CACHE_DIR and
imports them again in later runs; unset, that is $TMPDIR/torchinductor_<user>, made with
makedirs(exist_ok=True) and no owner check (torch 2.13 _inductor/runtime/cache_dir_utils.py cache_dir,
default_cache_dir): a user who makes that directory first can put code there that the ranks run.
Importing torch._dynamo already makes it (_dynamo/package.py DynamoCache, cache_dir()/dynamo; torch.optim
imports torch._dynamo): the node agent checks before torchrun starts, the trainer before its optimizer.
torch also uses default_cache_dir() itself, whatever TORCHINDUCTOR_CACHE_DIR says, for its precompiled
headers (_inductor/codecache.py _HEADER_DIR) and its on-disk memoizer (_inductor/runtime/caching/
implementations.py _OnDiskCacheImpl._base_dir). Triton keeps its compiled kernels and launchers under
TRITON_CACHE_DIR, by default $TRITON_HOME/.triton/cache with TRITON_HOME = ~ (triton/knobs.py
cache_knobs); inductor sets it to <cache dir>/triton/<device> when unset (_inductor/runtime/
triton_heuristics.py). Triton's dump and override directories (~/.triton/dump, ~/.triton/override) are
read only with TRITON_KERNEL_DUMP / TRITON_KERNEL_OVERRIDE on, and lie in the user's home.

`compile_cache_env(environ)` makes or checks all three: a real directory (a symlink is refused, never
followed), this user's, writable by nobody else, in parents where nobody else can rename or replace it;
one of this user's that others may only read (torch made it 0755) is narrowed to 0700. It returns
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for the ranks (values already in `environ`, from ddp_env,
are checked, not replaced), or raises CacheDirError, one line naming the path and why. Standard library
only: the node agent (ddp_train/agent.py) runs it before torchrun, the trainer again in each rank.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping

from ddp_train import storage
from ddp_train.errors import UserError

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"


class CacheDirError(UserError):
    """A compile cache directory another user could write to: `compile cache: VAR: path ...: why`."""

    def __init__(self, var: str, message: str) -> None:
        super().__init__("compile cache", var, message)


def compile_cache_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Make or check torch's default cache directory, inductor's and Triton's; their variables."""
    default = default_cache_dir(environ)
    _private(default, "TMPDIR")  # torch's own, whatever TORCHINDUCTOR_CACHE_DIR says (docstring)
    inductor = os.path.abspath(environ.get(INDUCTOR_ENV) or default)
    if inductor != default:
        _private(inductor, INDUCTOR_ENV)
    triton = os.path.abspath(environ.get(TRITON_ENV) or os.path.join(inductor, "triton"))
    _private(triton, TRITON_ENV)
    return {INDUCTOR_ENV: inductor, TRITON_ENV: triton}


def default_cache_dir(environ: Mapping[str, str]) -> str:
    """$TMPDIR/torchinductor_<user> as torch 2.13 computes it in a rank with this environment
    (_inductor/runtime/cache_dir_utils.py default_cache_dir: tempfile.gettempdir(), getpass.getuser())."""
    return os.path.join(_tempdir(environ), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", _user(environ)))


def _tempdir(environ: Mapping[str, str]) -> str:
    """tempfile.gettempdir()'s choice: $TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp, the first directory
    it can write in (https://docs.python.org/3/library/tempfile.html#tempfile.gettempdir)."""
    for candidate in [environ.get(v) for v in ("TMPDIR", "TEMP", "TMP")] + ["/tmp", "/var/tmp", "/usr/tmp"]:
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return os.path.abspath(candidate)
    return os.getcwd()


def _user(environ: Mapping[str, str]) -> str:
    """getpass.getuser()'s answer (LOGNAME, USER, LNAME, USERNAME, then the password database)."""
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        if environ.get(var):
            return environ[var]
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid_{os.getuid()}"


def _private(path: str, var: str) -> None:
    """`path` a directory of this user's that nobody else can write or swap: made 0700 if missing (its
    missing parents too), else checked, a symlink refused, never followed (storage.own_dir, strict: its
    parents root's or the user's, none writable by group or others unless sticky, like /tmp)."""
    try:
        storage.own_dir(path, private=True, links=False, strict=True)
    except storage.RefusedPath as e:
        raise CacheDirError(var, _why(e, var)) from None
    except OSError as e:
        raise CacheDirError(var, f"cannot make {e.filename or path}: {e.strerror}") from None


def _why(e: storage.RefusedPath, var: str) -> str:
    """The refusal in the words of a code cache (what another user could do with it, and the fix)."""
    path, below = e.path, os.path.dirname(e.below)
    if e.reason == "owner":
        return (
            f"{path} belongs to uid {e.uid}, not to you (uid {os.geteuid()}): whoever made it can put code "
            f"there that the ranks run; {_fix(path, var)}"
        )
    if e.reason == "writable":
        return (
            f"{path} is writable by group or others (mode {e.mode or 0:04o}): code the ranks load from it "
            f"may be anyone's; remove it (rm -rf {path}) and run again"
        )
    if e.reason in ("link", "type"):
        what = "a symbolic link" if e.reason == "link" else "not a directory"
        return f"{path} is {what}: {_fix(path, var)}"
    if e.reason == "parent owner":
        return (
            f"{path}, a parent of the cache, belongs to uid {e.uid}: it can replace the cache directory; "
            f"{_fix(below, var)}"
        )
    if e.reason == "parent writable":
        return (
            f"{path}, a parent of the cache, is writable by group or others without the sticky bit (mode "
            f"{e.mode or 0:04o}): they can replace the cache directory; {_fix(below, var)}"
        )
    if e.reason == "unreadable":
        return f"cannot check {path}: {e.note}"
    return f"cannot make {path}: {e.note}"


def _fix(path: str, var: str) -> str:
    if var == "TMPDIR":  # torch's default directory: only TMPDIR moves it
        return "set TMPDIR (in ddp_env) to a directory of yours, or have this one removed"
    return f"set {var} (in ddp_env) to a directory of yours"
