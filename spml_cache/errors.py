"""The exceptions the command line turns into a single line: `SpmlError` (exit code 1) and `Interrupted` (Ctrl-C,
exit code 130)."""

from __future__ import annotations


class SpmlError(Exception):
    """A problem the user can fix: the message names the file or flag and what to do."""


class Interrupted(Exception):
    """Ctrl-C during a stage: `kept` says what was kept, `command` the command that goes on (None: the same
    command again)."""

    def __init__(self, kept: str, command: str | None = None) -> None:
        super().__init__(kept)
        self.kept, self.command = kept, command
