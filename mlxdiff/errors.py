"""The one exception type for mistakes a user can make (bad paths, corrupt files, bad sizes).

The CLI prints such an error as one line and exits with code 2; anything else is a bug and keeps its traceback.
"""


class MlxdiffError(Exception):
    """A user-facing error: the message says what went wrong, where (file or key) and what to do."""
