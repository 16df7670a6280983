"""The run's writes on the node's disk, and their refusals.

StorageError: a write the disk refuses (full, over quota, read-only, no permission, I/O error): one line
naming the operation, the path, the filesystem's free space and what was kept.
RefusedPath: a path another user could make the run write through (issue #44): `own_dir` makes or checks
a directory as this user's, `create_new` (temp files, O_EXCL) and `open_output` open files without
following a symbolic link. Both exit 2 (exitcodes.BAD_INPUT: a bad environment, not a bug). Standard
library only: the node agent uses it through cachedirs."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from ddp_train.errors import UserError

# What a disk, not the code, makes a write fail with.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


class StorageError(UserError):
    """A refused write, rendered `<path>: <operation> failed: <error> (<free space>); <what was kept>`."""

    def __init__(self, operation: str, path: Path | str, cause: OSError, kept: str = "") -> None:
        self.operation, self.path, self.cause, self.kept = operation, Path(path), cause, kept
        code = errno.errorcode.get(cause.errno or 0, "")
        reason = f"{cause.strerror or cause}" + (f" ({code})" if code else "")
        tail = f"; {kept}" if kept else ""
        super().__init__(str(path), None, f"{operation} failed: {reason}; {free_space(path)}{tail}")

    def with_kept(self, kept: str) -> StorageError:
        """The same error, saying what was kept (filled in where that is known)."""
        return StorageError(self.operation, self.path, self.cause, kept)


def disk_error(exc: BaseException | None) -> OSError | None:
    """The OSError with a DISK_ERRNOS errno in `exc` or its chain, else None. torch.save reports a
    failed write of its zip writer as a RuntimeError ("unexpected pos") raised while handling the
    OSError of the write (torch 2.13 serialization.py _open_zipfile_writer.__exit__ calls
    write_end_of_file), so the cause sits in __context__."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _mount_point(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def free_space(path: Path | str) -> str:
    """`<free> free of <total> on <mount point>` for the filesystem that holds (or would hold) `path`."""
    mount = _mount_point(Path(path))
    try:
        usage = shutil.disk_usage(mount)
    except OSError:
        return f"free space of {mount} unknown"
    return f"{size_text(usage.free)} free of {size_text(usage.total)} on {mount}"


@contextlib.contextmanager
def guarded(operation: str, path: Path | str, kept: Callable[[], str] | str = "") -> Iterator[None]:
    """Turn a disk's refusal inside the block into a StorageError (other errors pass unchanged)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        cause = disk_error(exc)
        if cause is None:
            raise
        raise StorageError(operation, path, cause, kept() if callable(kept) else kept) from exc


# --- paths another user could redirect (issues #24, #44) --------------------------------------------


class RefusedPath(UserError):
    """A path the run will not write through: a symbolic link, or a directory or file that is not this
    user's alone. One line `<path>: <why>; <fix>`; `reason` names the check that failed ("link", "type",
    "owner", "writable", "parent owner", "parent writable", "unreadable", "cannot make") and `uid`,
    `mode`, `below` (the directory a parent leads to) and `note` fill it in (cachedirs words its own)."""

    def __init__(
        self,
        path: Path | str,
        reason: str,
        *,
        fix: str = "",
        uid: int | None = None,
        mode: int | None = None,
        below: str = "",
        note: str = "",
    ) -> None:
        self.path, self.reason, self.uid, self.mode = str(path), reason, uid, mode
        self.below, self.note = below, note
        me = os.geteuid()
        why = {
            "link": f"a symbolic link{f' of uid {uid}' if uid not in (None, 0, me) else ''}{note}",
            "type": f"not a {note}",
            "owner": f"belongs to uid {uid}, not to you (uid {me}){note}",
            "writable": f"writable by group or others (mode {mode or 0:04o}): they could redirect what is "
            f"written there; chmod go-w {path} if everything in it is yours, or",
            "parent owner": f"{note or 'a directory'} of uid {uid} on the way to {below}: its owner can "
            + ("point it elsewhere" if note else "put another in its place"),
            "parent writable": f"a parent of {below}, writable by others without the sticky bit "
            f"(mode {mode or 0:04o}): they can replace what lies below",
            "unreadable": f"cannot check it ({note})",
            "cannot make": f"cannot make it ({note})",
        }[reason]
        fix = fix or "use a directory of yours (run.dir, checkpoint.dir)"
        super().__init__(str(path), None, f"{why} {fix}" if reason == "writable" else f"{why}; {fix}")


def own_dir(
    path: Path | str,
    *,
    fix: str = "",
    private: bool = False,
    links: bool = True,
    strict: bool = False,
) -> None:
    """Make `path` (and its missing parents) or check it: a directory of this user's that group and others
    cannot write (`private`: made 0700, and narrowed to 0700 when others may only read it). A symbolic
    link there is followed only with `links` and only when it is the user's own or root's (run.dir ->
    /scratch/me); another user's is refused, never followed. Its parents: every symbolic link on the way
    the user's or root's, and no directory writable by others without the sticky bit (`strict`, for code
    caches: also none writable by the group, and each one root's or the user's). Raises RefusedPath; a
    disk's refusal of the mkdir (DISK_ERRNOS) is raised as the OSError, for `guarded`."""
    path = os.path.join(os.getcwd(), os.fspath(path))  # absolute, its ".." and links kept for the walk
    me = os.geteuid()
    parent = os.path.dirname(path)
    if parent != path and not os.path.lexists(parent):
        own_dir(parent, fix=fix, private=private, links=links, strict=strict)
    _check_parents(parent, path, me, strict, fix)
    try:
        os.mkdir(path, 0o700 if private else 0o755)  # mkdir(2) never follows a symlink at `path`: EEXIST
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno in DISK_ERRNOS:
            raise
        raise RefusedPath(path, "cannot make", fix=fix, note=e.strerror or str(e)) from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise RefusedPath(path, "unreadable", fix=fix, note=e.strerror or str(e)) from None
    if stat.S_ISLNK(st.st_mode):
        if not links or st.st_uid not in (0, me):
            raise RefusedPath(path, "link", fix=fix, uid=st.st_uid, note=", never followed")
        own_dir(os.path.realpath(path), fix=fix, private=private, links=False, strict=strict)
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):  # replaced by a link since the lstat
            raise RefusedPath(path, "link", fix=fix, note=", never followed") from None
        raise RefusedPath(path, "type", fix=fix, note=f"directory ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != me:
            note = ": its owner could make this run write through links of theirs"
            raise RefusedPath(path, "owner", fix=fix, uid=st.st_uid, note=note)
        if st.st_mode & 0o022:
            raise RefusedPath(path, "writable", fix=fix, mode=stat.S_IMODE(st.st_mode))
        if private and st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # ours, others could only read it: nothing to distrust
    finally:
        os.close(fd)


def _check_parents(parent: str, below: str, me: int, strict: bool, fix: str) -> None:
    """Nobody else can swap a component of `parent` for theirs: a symbolic link on the way is root's or
    this user's (in a sticky /tmp only its owner can replace it), and its target's path passes the same
    test; no directory is writable by others (`strict`: or the group) unless sticky; `strict`: every
    directory root's or this user's."""
    parts = parent.split(os.sep)
    for i in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:i]) or os.sep
        try:
            st = os.lstat(prefix)
        except OSError as e:
            raise RefusedPath(prefix, "unreadable", fix=fix, below=below, note=e.strerror or str(e)) from None
        link = stat.S_ISLNK(st.st_mode)
        if st.st_uid not in (0, me) and (link or strict):
            note = "a symbolic link" if link else ""
            raise RefusedPath(prefix, "parent owner", fix=fix, uid=st.st_uid, below=below, note=note)
        if not link and st.st_mode & (0o022 if strict else 0o002) and not st.st_mode & stat.S_ISVTX:
            raise RefusedPath(prefix, "parent writable", fix=fix, mode=stat.S_IMODE(st.st_mode), below=below)
    real = os.path.realpath(parent)
    if real != os.path.normpath(parent):
        _check_parents(real, below, me, strict, fix)


def create_new(path: Path | str, perms: int = 0o600) -> int:
    """A new file for writing (O_CREAT|O_EXCL|O_NOFOLLOW, `perms` less the umask), never through a
    symlink nor into an existing file: a leftover of that name (a killed writer's temp file, or a link)
    is removed first. For temp files that are then os.replace()d, and the ranks' stack dumps."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, perms)
    except FileExistsError:
        os.unlink(path)  # the name itself, never what a link points to
        return os.open(path, flags, perms)


def open_output(path: Path | str, mode: str = "w", *, encoding: str | None = None) -> IO[Any]:
    """open(path, mode) for writing ("w", "a", "wb", "ab") that never follows a symbolic link at `path`
    (O_NOFOLLOW) nor writes into a file that is not this user's: both refused (RefusedPath)."""
    if mode.strip("b") not in ("w", "a"):
        raise ValueError(f"open_output: mode {mode!r} is not w, a, wb or ab")
    return open(path, mode, encoding=encoding, opener=_no_follow)


def _no_follow(path: str, flags: int) -> int:
    """open()'s opener: its flags plus O_NOFOLLOW; the file checked before O_TRUNC's truncation."""
    truncate = flags & os.O_TRUNC
    flags = (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO: no hang
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            note = f" (to {os.readlink(path)}), never written through"
            raise RefusedPath(path, "link", fix="remove it", note=note) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedPath(path, "type", fix="remove it", note="regular file")
        if st.st_uid != os.geteuid():
            raise RefusedPath(path, "owner", fix="remove it", uid=st.st_uid)
        os.set_blocking(fd, True)
        if truncate:
            os.ftruncate(fd, 0)  # after the checks: nobody else's file is ever emptied
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def publish(final: Path, write: Callable[[BinaryIO], object], delay_s: float = 0.0) -> Path:
    """Give `final` the bytes write() puts in a temp file: flush, fsync, rename, fsync the directory."""
    directory = final.parent
    own_dir(directory)  # this user's, nobody else's links in it (issue #44)
    tmp = directory / (final.name + ".tmp")
    try:
        with open(tmp, "wb", opener=lambda p, _: create_new(p, 0o666)) as f:  # O_EXCL|O_NOFOLLOW
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if delay_s:
            time.sleep(delay_s)  # test hook: a window in which the writer can be killed
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return final


def link(target: Path, final: Path) -> Path:
    """`final` as a hard link to `target`, atomically (a linked temp name, rename, fsync the directory);
    OSError where the two lie on different filesystems."""
    own_dir(final.parent)
    tmp = final.with_name(final.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a left-over, or a planted link: replaced, never followed
    os.link(target, tmp, follow_symlinks=False)
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)
    return final
