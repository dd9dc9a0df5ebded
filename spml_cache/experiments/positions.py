"""Where each key and value of a TOML file is, by line: tomllib gives positions for syntax errors only, and an
experiment names the line of every key it refuses.

`key_lines(text)` maps the path of each key and array element to its line: `("linear", "loss")`, an array of
tables' entries by index (`("finetune", 1, "loss")`), an array's elements too (`("axes", "dataset", 2)`). It reads a
file tomllib has already accepted, so it knows only what it needs of the grammar: comments, the four kinds of
string, arrays, inline tables, headers, and dotted or quoted keys.
"""

from __future__ import annotations

import re

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text, self.at, self.line = text, 0, 1
        self.lines: dict[tuple, int] = {}
        self.entries: dict[tuple, int] = {}  # an array of tables' entries so far

    def peek(self, count: int = 1) -> str:
        return self.text[self.at:self.at + count]

    def advance(self, count: int = 1) -> None:
        self.line += self.text.count("\n", self.at, self.at + count)
        self.at += count

    def blank(self, newlines: bool) -> None:
        """Skip spaces (and, with `newlines`, line ends) and comments."""
        while self.at < len(self.text):
            char = self.peek()
            if char in " \t\r" or (newlines and char == "\n"):
                self.advance()
            elif char == "#":
                end = self.text.find("\n", self.at)
                self.advance((len(self.text) if end < 0 else end) - self.at)
            else:
                return

    def document(self) -> dict[tuple, int]:
        table: tuple = ()
        while True:
            self.blank(newlines=True)
            if self.at >= len(self.text):
                return self.lines
            began = self.at
            if self.peek() == "[":
                table = self.header()
            else:
                self.pair(table)
            if self.at == began:
                raise IndexError(self.at)

    def header(self) -> tuple:
        many = self.peek(2) == "[["
        self.advance(2 if many else 1)
        path = self.key()
        self.advance(2 if many else 1)
        if many:
            index = self.entries.get(path, -1) + 1
            self.entries[path] = index
            path = (*path, index)
        self.lines[path] = self.line
        return path

    def key(self) -> tuple:
        parts = []
        while True:
            self.blank(newlines=False)
            if self.peek() in "\"'":
                start = self.at
                self.string()
                parts.append(self.text[start + 1:self.at - 1])
            else:
                found = BARE_KEY.match(self.text, self.at)
                parts.append(found.group())
                self.advance(found.end() - self.at)
            self.blank(newlines=False)
            if self.peek() != ".":
                return tuple(parts)
            self.advance()

    def pair(self, table: tuple) -> None:
        line, path = self.line, (*table, *self.key())
        self.advance()  # "="
        self.lines[path] = line
        self.value(path)

    def value(self, path: tuple) -> None:
        self.blank(newlines=False)
        char = self.peek()
        if char == "[":
            self.items(path, "]", lambda index: (*path, index))
        elif char == "{":
            self.items(path, "}", None)
        elif char in "\"'":
            self.string()
        else:  # a number, a boolean or a date: up to the next separator
            found = re.compile(r"[^,\]}\n#]*").match(self.text, self.at)
            self.advance(found.end() - self.at)

    def items(self, path: tuple, close: str, element) -> None:
        """An array (`element`: each element's path from its index) or an inline table (its keys' pairs)."""
        self.advance()
        index = 0
        while True:
            self.blank(newlines=True)
            began = self.at
            if self.peek() == close:
                self.advance()
                return
            if element is None:
                self.pair(path)
            else:
                self.lines[element(index)] = self.line
                self.value(element(index))
            self.blank(newlines=True)
            if self.peek() == ",":
                self.advance()
                index += 1
            elif self.at == began:  # nothing read: a form this scan does not know
                raise IndexError(self.at)

    def string(self) -> None:
        quote = self.peek()
        fence = quote * 3 if self.peek(3) == quote * 3 else quote
        self.advance(len(fence))
        while not self.text.startswith(fence, self.at):
            self.advance(2 if quote == '"' and self.peek() == "\\" else 1)
        while self.text.startswith(quote, self.at + len(fence)) and len(fence) == 3:  # """a"""" ends on the last
            self.advance()
        self.advance(len(fence))


def key_lines(text: str) -> dict[tuple, int]:
    """`{path: line}` of every key, array element and array-of-tables entry of a valid TOML document (an empty map
    where the scan meets what it does not know: lines are then given by the nearest table)."""
    try:
        return _Scanner(text).document()
    except (AttributeError, IndexError):
        return {}


def line_of(lines: dict[tuple, int], path: tuple) -> int:
    """The line of `path`, else of the nearest key above it (0: none known)."""
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return 0
