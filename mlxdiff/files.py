"""What a path is, before anything opens it: the bottom floor, so that readers at every floor (formats, tokenizers,
arguments) refuse a FIFO, a device or a socket in the same words."""

import stat

# what a path that is not a regular file is: open() blocks on a FIFO until a writer comes, a character device
# (/dev/zero, /dev/urandom) has no end, a socket cannot be opened at all
_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode) -> str | None:
    """None for a regular file; else what it is ("a FIFO (named pipe)", "a character device", ...)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
