"""The words of a shell script, split as bash splits them but not yet expanded: one list of raw words per simple
command, quotes and ``$(...)`` / ``${...}`` / ``$((...))`` / array literals kept whole inside their word, so
`hybridflow.config.shell_eval` can expand them knowing what was quoted. Nothing is executed.

Commands end at a newline, ``;``, ``&&``, ``||``, ``|`` or ``&`` (inside ``[[ ... ]]`` ``&&`` and ``||`` are
words); backslash-newline joins lines; ``#`` at the start of a word comments to the end of the line;
redirections (``>/dev/null``, ``2>&1``) are dropped with their target. An unbalanced quote or bracket raises
`ShellSyntaxError` naming the line it opened on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ARRAY_START = re.compile(r"^[A-Za-z_]\w*\+?=$")
REDIRECT = re.compile(r"\d*(?:<<<|<<-?|>>|>&|<&|&>|>|<)(\d+-?)?")


class ShellSyntaxError(ValueError):
    """A script the lexer cannot split (an unbalanced quote or bracket), naming the line."""


@dataclass
class Command:
    """One simple command: its raw words and the line it starts on."""

    words: list[str]
    line: int


def _close_quote(text: str, i: int, line: int) -> int:
    """Index of the quote closing the one at `i` (a double-quoted part may hold ``$(...)`` with its own quotes)."""
    quote, j = text[i], i + 1
    while j < len(text):
        c = text[j]
        if c == quote:
            return j
        if quote == '"' and c == "\\":
            j += 2
            continue
        if quote == '"' and c == "$" and text[j + 1:j + 2] in ("(", "{"):
            j = close_group(text, j + 1, line) + 1
            continue
        if quote == '"' and c == "`":
            j = _close_quote(text, j, line) + 1
            continue
        j += 1
    raise ShellSyntaxError(f"line {line}: unbalanced {quote} (opened here and never closed)")


def close_group(text: str, i: int, line: int) -> int:
    """Index of the bracket closing the ``(`` or ``{`` at `i`, skipping quoted text."""
    opening = text[i]
    closing = ")" if opening == "(" else "}"
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c in "'\"`":
            j = _close_quote(text, j, line)
        elif c == "\\":
            j += 1
        elif c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return j
        j += 1
    raise ShellSyntaxError(f"line {line}: unbalanced {opening} (opened here and never closed)")


def lex(text: str) -> list[Command]:
    """The script's simple commands (see the module docstring)."""
    commands: list[Command] = []
    words: list[str] = []
    word: str | None = None
    skip_target = False
    line = start = 1
    i, n = 0, len(text)

    def end_word() -> None:
        nonlocal word, skip_target
        if word is not None:
            if skip_target:
                skip_target = False
            else:
                words.append(word)
        word = None

    def end_command() -> None:
        nonlocal words
        end_word()
        if words:
            commands.append(Command(words, start))
        words = []

    while i < n:
        c = text[i]
        if not words and word is None and c not in " \t\n;&|":
            start = line
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                line += 1
            else:
                word = (word or "") + text[i:i + 2]
            i += 2
            continue
        if c in " \t":
            end_word()
        elif c == "\n":
            end_command()
            line += 1
        elif c in "<>" or (c == "&" and text[i + 1:i + 2] == ">"):
            if word is not None and not word.isdigit():
                end_word()
            match = REDIRECT.match(text, i)
            assert match is not None  # the pattern matches any of these characters
            word = None
            i = match.end()
            if not match.group(1) and not match.group(0).endswith("&"):
                skip_target = True  # `> file`: the file is the redirection's, not the command's
            continue
        elif "[[" in words and "]]" not in words and text[i:i + 2] in ("&&", "||"):
            end_word()
            words.append(text[i:i + 2])  # inside `[[ ]]`: an operator of the test, not a command separator
            i += 1
        elif c in ";&|":
            end_command()
            if c == ";" and text[i:i + 2] == ";;":
                i += 1
            elif c in "&|" and text[i:i + 2] in ("&&", "||"):
                i += 1
        elif c == "#" and word is None:
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c in "'\"`":
            j = _close_quote(text, i, line)
            line += text.count("\n", i, j)
            word = (word or "") + text[i:j + 1]
            i = j + 1
            continue
        elif c == "$" and text[i + 1:i + 2] in ("(", "{"):
            j = close_group(text, i + 1, line)
            line += text.count("\n", i, j)
            word = (word or "") + text[i:j + 1]
            i = j + 1
            continue
        elif c == "(" and (word is None and text[i:i + 2] == "((" or word is not None and ARRAY_START.match(word)):
            j = close_group(text, i, line)  # an array literal `a=(...)`, or arithmetic `(( ... ))`
            line += text.count("\n", i, j)
            word = (word or "") + text[i:j + 1]
            i = j + 1
            continue
        elif c == "(" and text[i:i + 2] == "()":
            word = (word or "") + "()"  # a function definition `name() {`
            i += 2
            continue
        else:
            word = (word or "") + c
        i += 1
    end_command()
    return commands
