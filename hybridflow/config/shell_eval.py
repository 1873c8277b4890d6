"""What a shell script's commands say, worked out without running anything: `evaluate` walks the commands of
`hybridflow.config.shell_lexer` in order, keeping the variables they assign, and returns each active command's
words expanded as bash would expand them (`hybridflow.config.shell_words`).

Understood at the command level: assignments (``NAME=v``, ``export``/``local``/``declare``/``readonly``, ``+=``,
``NAME[i]=v``, ``a=(...)``, ``unset``), ``VAR=x command`` (the variable exported for that command), and
``if``/``elif``/``else`` on ``[ ]`` / ``[[ ]]`` string and integer tests (one it cannot decide is read as true and
named in `Script.notes`; an ``exit`` inside a branch is ignored: the script is read as if given the arguments it
asks for; an ``exit`` outside one ends it). Loop, ``case`` and function bodies are skipped (a function's name is
kept, so ``$(now)`` is named as the script's function). Every other command is recorded with its words.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.config.shell_lexer import lex
from hybridflow.config.shell_words import NAME, Expander, Word

ASSIGN = re.compile(r"^([A-Za-z_]\w*)(\[[^\]]*\])?(\+?)=(.*)$", re.S)
DECLARE = ("export", "local", "declare", "readonly", "typeset")
BLOCK_START = {"for": "done", "while": "done", "until": "done", "case": "esac", "select": "done"}
BINARY = {"=": operator.eq, "==": operator.eq, "!=": operator.ne}
NUMERIC = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le, "-gt": operator.gt,
           "-ge": operator.ge}


@dataclass
class Script:
    """The result of `evaluate`: the active commands' expanded words (with their lines), the variables at the
    end, the names the script exports, and notes on what was not worked out."""

    commands: list[tuple[int, list[Word]]] = field(default_factory=list)
    variables: dict[str, str | list[str]] = field(default_factory=dict)
    exported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _assign(ev: Expander, out: Script, word: str, exported: bool) -> None:
    """``NAME=v``, ``NAME+=v``, ``NAME[i]=v``, ``NAME=(...)``, ``NAME+=(...)``."""
    match = ASSIGN.match(word)
    assert match is not None
    name, index, append, raw = match.groups()
    if raw.startswith("(") and raw.endswith(")") and index is None:
        items = [w.text for part in lex(raw[1:-1]) for w in ev.expand_command(part.words)]
        old = ev.vars.get(name, [])
        ev.vars[name] = (old if isinstance(old, list) else [old]) + items if append else items
    else:
        words = ev.expand(raw)
        value = words[0].text if words else ""
        for w in words[1:]:
            value += " " + w.text  # an assignment's value is not split
        old_value = ev.vars.get(name, "")
        if index is not None:
            items = list(old_value) if isinstance(old_value, list) else ([old_value] if old_value else [])
            position = int(ev.arithmetic(index[1:-1], index[1:-1]))
            items += [""] * (position + 1 - len(items))
            items[position] = value
            ev.vars[name] = items
        else:
            ev.vars[name] = (old_value if isinstance(old_value, str) else " ".join(old_value)) + value \
                if append else value
    if exported and name not in out.exported:
        out.exported.append(name)


def _test(words: list[str]) -> bool | None:
    """``[ ... ]`` / ``[[ ... ]]`` / ``test ...``: True, False, or None when it cannot be decided here."""
    args = [w for w in words if w not in ("[", "]", "[[", "]]", "test")]
    for op in ("||", "&&"):  # `[[ a && b || c ]]`: || binds loosest
        if op in args:
            at = args.index(op)
            left, right = _test(args[:at]), _test(args[at + 1:])
            if left is None or right is None:
                return None
            return (left or right) if op == "||" else (left and right)
    negate = args[:1] == ["!"]
    args = args[1:] if negate else args
    result: bool | None = None
    if len(args) == 3 and args[1] in BINARY and "$" not in args[0] + args[2]:
        result = BINARY[args[1]](args[0], args[2]) if "*" not in args[2] else \
            fnmatch.fnmatchcase(args[0], args[2])
    elif len(args) == 3 and args[1] in NUMERIC and all(a.lstrip("-").isdigit() for a in (args[0], args[2])):
        result = NUMERIC[args[1]](int(args[0]), int(args[2]))
    elif len(args) == 2 and args[0] in ("-n", "-z") and "$" not in args[1]:
        result = bool(args[1]) == (args[0] == "-n")
    elif len(args) == 1 and "$" not in args[0]:
        result = bool(args[0])
    return None if result is None else result != negate


def evaluate(text: str, script: Path, workdir: Path, env: Mapping[str, str]) -> Script:
    """The script's commands, expanded (see the module docstring). `env` is the environment it starts with."""
    ev = Expander(script, workdir, dict(env))
    out = Script()
    frames: list[list[Any]] = []  # [kind, active, a branch was taken]
    skip_until: list[str] = []  # closing words of loops, case blocks and function bodies being skipped
    for command in lex(text):
        raws = list(command.words)
        while raws and raws[0] in ("then", "do", "else", "{") and not skip_until:
            if raws[0] == "else" and frames:
                frame = frames[-1]
                frame[1] = not frame[2] and _parent_active(frames[:-1])
                frame[2] = True
            raws = raws[1:]
        if not raws:
            continue
        head = raws[0]
        if skip_until:
            if head in BLOCK_START or head.endswith("()") or head == "function" or raws[-1] == "{":
                skip_until.append("}" if head.endswith("()") or head == "function" or raws[-1] == "{" and
                                  head not in BLOCK_START else BLOCK_START[head])
            elif head in ("done", "esac", "}") and head == skip_until[-1]:
                skip_until.pop()
            continue
        if head in BLOCK_START:
            skip_until.append(BLOCK_START[head])
            continue
        if head.endswith("()") or head == "function":
            ev.functions.add((head[:-2] if head.endswith("()") else raws[1]).removesuffix("()"))
            if raws[-1] != "}":
                skip_until.append("}")
            continue
        active = _parent_active(frames[:-1] if head == "elif" else frames)
        if head in ("if", "elif"):
            decided = _test([w.text for w in ev.expand_command(raws[1:])]) if active else False
            if decided is None:
                decided = True
                ev.notes.append(f"line {command.line}: `{' '.join(raws)}` cannot be decided here; read as true")
            if head == "if":
                frames.append(["if", active and decided, active and decided])
            elif frames:
                frame = frames[-1]
                frame[1] = not frame[2] and decided and active
                frame[2] = frame[2] or frame[1]
            continue
        if head == "fi":
            if frames:
                frames.pop()
            continue
        if not active:
            continue
        if head == "exit":
            if not frames:
                break  # the script ends here
            continue  # a usage check's exit: the script is read as if given what it asks for
        _run(ev, out, raws, command.line)
    out.variables, out.notes = ev.vars, ev.notes
    return out


def _parent_active(frames: list[list[Any]]) -> bool:
    return all(frame[1] for frame in frames)


def _run(ev: Expander, out: Script, raws: list[str], line: int) -> None:
    """One active simple command: assignments change the variables; any other command is recorded."""
    exported = raws[0] in DECLARE
    if exported:
        raws = [r for r in raws[1:] if not r.startswith("-")]
        for raw in raws:
            if ASSIGN.match(raw):
                _assign(ev, out, raw, True)
            elif NAME.fullmatch(raw) and raw not in out.exported:
                out.exported.append(raw)
        return
    prefix = 0
    while prefix < len(raws) and ASSIGN.match(raws[prefix]):
        prefix += 1
    if prefix == len(raws):
        for raw in raws:
            _assign(ev, out, raw, False)
        return
    for raw in raws[:prefix]:  # `VAR=x command`: the variable is the command's environment
        _assign(ev, out, raw, True)
    if raws[prefix] == "unset":
        for name in raws[prefix + 1:]:
            ev.vars.pop(name, None)
        return
    out.commands.append((line, ev.expand_command(raws[prefix:])))
