"""The one exception type the command line turns into a single red line (exit code 1)."""


class SpmlError(Exception):
    """A problem the user can fix: the message names the file or flag and what to do."""
