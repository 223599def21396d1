"""What a path is, before anything opens it, and a user's small file read safely: the bottom floor, so that readers
at every floor (formats, tokenizers, loading, arguments) refuse a FIFO, a device or a socket in the same words."""

import os
import stat

from .errors import MlxdiffError

# what a path that is not a regular file is: open() blocks on a FIFO until a writer comes, a character device
# (/dev/zero, /dev/urandom) has no end, a socket cannot be opened at all
_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode) -> str | None:
    """None for a regular file; else what it is ("a FIFO (named pipe)", "a character device", ...)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")


def _size(n) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n} bytes"


def _not_regular(what, kind, limit) -> MlxdiffError:
    if kind == "a folder":
        return MlxdiffError(f"{what}: cannot read it (it is a folder); give a file")
    why = {"a FIFO (named pipe)": " (reading one waits for a writer, maybe forever)",
           "a character device": " (one can be endless" + (f", far larger than {_size(limit)}" if limit else "") + ")",
           "a block device": " (a whole disk)"}.get(kind, "")
    return MlxdiffError(f"{what}: cannot read it: {kind}, not a regular file{why}; give a regular file")


def check_regular(path, what, limit=None, advice="give a smaller file") -> int:
    """A user's file, stat'ed before anything opens it (links followed): it must be a regular file, of at most
    `limit` bytes when given. Returns its size. `what` names it in the one-line errors, `advice` says what to do when
    it is too large."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise MlxdiffError(f"{what}: cannot read it ({e.strerror or e})") from None
    kind = file_kind(info.st_mode)
    if kind is not None:
        raise _not_regular(what, kind, limit)
    if limit is not None and info.st_size > limit:
        raise MlxdiffError(f"{what}: larger than {_size(limit)} ({info.st_size} bytes); {advice}")
    return info.st_size


def read_capped(path, limit, what, advice="give a smaller file") -> bytes:
    """A user's small file read whole, safely: stat'ed first (check_regular: a FIFO, a device, a socket or a folder
    is refused before anything opens it), opened without blocking, checked again on the open descriptor (the path
    may have been swapped in between) and read with a bound of `limit` bytes (a file that grows is not read without
    end). `what` names it in the one-line errors, `advice` says what to do when it is too large."""
    check_regular(path, what, limit, advice)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise MlxdiffError(f"{what}: cannot read it ({e.strerror or e})") from None
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise _not_regular(what, kind, limit)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise MlxdiffError(f"{what}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise MlxdiffError(f"{what}: larger than {_size(limit)}; {advice}")
    return data
