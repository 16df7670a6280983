"""A write of the run that the node's disk refuses (full, over quota, read-only, no permission, I/O
error): one line naming the operation, the path, the filesystem's free space and what was kept;
exit code 2 (exitcodes.BAD_INPUT: a bad environment, not a bug)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

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
