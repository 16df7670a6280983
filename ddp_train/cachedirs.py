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
import stat
from collections.abc import Mapping

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
    missing parents too), else checked; opened O_NOFOLLOW, so a symlink is refused, never followed."""
    me = os.geteuid()
    parent = os.path.dirname(path)
    if parent != path and not os.path.lexists(parent):
        _private(parent, var)
    _check_parents(parent, var, me)
    try:
        os.mkdir(path, 0o700)  # mkdir(2) never follows a symlink at `path`: EEXIST instead
    except FileExistsError:
        pass
    except OSError as e:
        raise CacheDirError(var, f"cannot make {path}: {e.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        what = "a symbolic link" if os.path.islink(path) else f"not a directory ({e.strerror})"
        raise CacheDirError(var, f"{path} is {what}: {_fix(path, var)}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != me:
            raise CacheDirError(
                var, f"{path} belongs to uid {st.st_uid}, not to you (uid {me}): whoever made it can put "
                f"code there that the ranks run; {_fix(path, var)}"
            )  # fmt: skip
        if st.st_mode & 0o022:
            raise CacheDirError(
                var, f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): code the "
                f"ranks load from it may be anyone's; remove it (rm -rf {path}) and run again"
            )  # fmt: skip
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # ours, others could only read it (torch made it 0755): nothing to distrust
    finally:
        os.close(fd)


def _check_parents(parent: str, var: str, me: int) -> None:
    """Nobody else can rename or replace a component of `parent`: each directory is root's or this user's
    and not writable by group or others unless sticky (/tmp); a symlink on the way is root's or this
    user's (in a sticky /tmp only its owner can replace it), and its target's path passes the same test."""
    parts = parent.split(os.sep)
    for i in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:i]) or os.sep
        try:
            st = os.lstat(prefix)
        except OSError as e:
            raise CacheDirError(var, f"cannot check {prefix}: {e.strerror}") from None
        if st.st_uid not in (0, me):
            raise CacheDirError(
                var, f"{prefix}, a parent of the cache, belongs to uid {st.st_uid}: it can replace the cache "
                f"directory; {_fix(parent, var)}"
            )  # fmt: skip
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise CacheDirError(
                var, f"{prefix}, a parent of the cache, is writable by group or others without the sticky "
                f"bit (mode {stat.S_IMODE(st.st_mode):04o}): they can replace the cache directory; "
                f"{_fix(parent, var)}"
            )  # fmt: skip
    real = os.path.realpath(parent)
    if real != os.path.normpath(parent):
        _check_parents(real, var, me)


def _fix(path: str, var: str) -> str:
    if var == "TMPDIR":  # torch's default directory: only TMPDIR moves it
        return "set TMPDIR (in ddp_env) to a directory of yours, or have this one removed"
    return f"set {var} (in ddp_env) to a directory of yours"
