"""Expanding one shell word as bash would, without running anything: the part of
`hybridflow.config.shell_eval` that turns a raw word of `hybridflow.config.shell_lexer` into its fields.

`Expander.expand` handles quoting (single, double, backslash), ``$NAME`` / ``${NAME}``, ``${NAME:-default}`` (and
``-``, ``:=``, ``:+``, ``:?``, ``#``/``%`` pattern removal, ``${#NAME}``), arrays (``"${a[@]}"`` one field per item,
``${a[0]}``, ``${#a[@]}``), ``$((...))`` integer arithmetic (names are variables, unset = 0), positional ``$1``
(the script gets no arguments: kept as written), and the command substitutions it can compute: ``$(pwd)``,
``$(dirname X)``, ``$(basename X [SUFFIX])``, ``$(cd X && pwd)``, ``$(realpath X)``, ``$(readlink -f X)``,
``$(echo ...)``. Any other substitution is not run: it stays in the word as written and is named in `notes`. An
unset variable stays as written (``$NAME``) for the caller to name. Variables whose name marks a secret
(`is_secret`) are tracked: each `Word` says which it used.
"""

from __future__ import annotations

import ast
import fnmatch
import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config.shell_lexer import close_group, lex

NAME = re.compile(r"[A-Za-z_]\w*")
SECRET = re.compile(r"(_KEY|_TOKEN|_SECRET|PASSWORD|_PASS)$|^(WANDB_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN|OPENAI_|"
                    r"ANTHROPIC_|AWS_SECRET|SWANLAB_API|MLFLOW_TRACKING_PASSWORD)", re.I)
ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
         ast.Pow: operator.pow, ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv,
         ast.LShift: operator.lshift, ast.RShift: operator.rshift}


def is_secret(name: str) -> bool:
    """A variable holding a credential: ``*_KEY``, ``*_TOKEN``, ``WANDB_*``, ``HF_TOKEN``, ..."""
    return bool(SECRET.search(name))


@dataclass
class Word:
    """An expanded word and the secret variables its value came from."""

    text: str
    secrets: frozenset[str] = frozenset()


class Expander:
    """Expands words against `vars` (the environment given, ``$PWD`` = `workdir`, ``$0`` = `script`); `notes`
    collects what could not be worked out, `functions` holds the script's function names (for those notes)."""

    def __init__(self, script: Path, workdir: Path, env: dict[str, str]) -> None:
        self.script, self.workdir = script, workdir
        self.vars: dict[str, str | list[str]] = {**env, "PWD": str(workdir), "0": str(script),
                                                 "BASH_SOURCE": str(script)}
        self.functions: set[str] = set()
        self.notes: list[str] = []
        self.used: set[str] = set()  # secret variables read while expanding the current word

    def expand(self, raw: str) -> list[Word]:
        """The fields `raw` expands to (unquoted expansions split on whitespace, ``"${a[@]}"`` one per item)."""
        self.used = set()
        fields: list[str] = [""]
        started = False  # a quoted empty string is still a word
        i = 0
        while i < len(raw):
            c = raw[i]
            if c == "'":
                j = raw.index("'", i + 1)
                fields[-1] += raw[i + 1:j]
                started, i = True, j + 1
            elif c == '"':
                j = self._close_double(raw, i)
                parts = self._expand_quoted(raw[i + 1:j])
                fields[-1] += parts[0]
                fields += parts[1:]
                started, i = True, j + 1
            elif c == "\\":
                fields[-1] += raw[i + 1:i + 2]
                started, i = True, i + 2
            elif c in "$`":
                value, i = self._dollar(raw, i)
                items = value if isinstance(value, list) else [value]
                words = [w for item in items for w in _split(item)]
                if words:
                    if items[0][:1].isspace() and fields[-1]:
                        fields.append("")
                    fields[-1] += words[0]
                    fields += words[1:]
                    started = True
            else:
                fields[-1] += c
                started, i = True, i + 1
        secrets = frozenset(self.used)
        return [Word(f, secrets) for f in fields] if started else []

    @staticmethod
    def _close_double(raw: str, i: int) -> int:
        j = i + 1
        while raw[j] != '"':
            if raw[j] == "\\":
                j += 1
            elif raw[j] == "$" and raw[j + 1:j + 2] in ("(", "{"):
                j = close_group(raw, j + 1, 0)
            j += 1
        return j

    def _expand_quoted(self, raw: str) -> list[str]:
        """A double-quoted part: no splitting, but ``"${a[@]}"`` gives one field per item."""
        fields = [""]
        i = 0
        while i < len(raw):
            c = raw[i]
            if c == "\\" and raw[i + 1:i + 2] in ('"', "\\", "$", "`"):
                fields[-1] += raw[i + 1]
                i += 2
            elif c in "$`":
                value, i = self._dollar(raw, i)
                if isinstance(value, list):
                    fields[-1] += value[0] if value else ""
                    fields += value[1:]
                else:
                    fields[-1] += value
            else:
                fields[-1] += c
                i += 1
        return fields

    def _get(self, name: str) -> str | list[str] | None:
        if is_secret(name) and name in self.vars:
            self.used.add(name)
        return self.vars.get(name)

    def _dollar(self, raw: str, i: int) -> tuple[str | list[str], int]:
        """The value of the expansion starting at `i` and the index after it."""
        if raw[i] == "`":
            j = raw.index("`", i + 1)
            return self._substitute(raw[i + 1:j], raw[i:j + 1]), j + 1
        nxt = raw[i + 1:i + 2]
        if raw.startswith("$((", i):
            j = close_group(raw, i + 1, 0)
            return self.arithmetic(raw[i + 3:j - 1], raw[i:j + 1]), j + 1
        if nxt == "(":
            j = close_group(raw, i + 1, 0)
            return self._substitute(raw[i + 2:j], raw[i:j + 1]), j + 1
        if nxt == "{":
            j = close_group(raw, i + 1, 0)
            return self._parameter(raw[i + 2:j]), j + 1
        if nxt in ("@", "*"):
            return [], i + 2  # no arguments are given to the script
        if nxt == "#":
            return "0", i + 2
        if nxt.isdigit():  # the script is given no arguments: $1 stays as written, for the caller to name
            return (f"${nxt}" if nxt != "0" else str(self.script)), i + 2
        match = NAME.match(raw, i + 1)
        if match is None:
            return "$", i + 1
        value = self._get(match.group(0))
        if value is None:
            return f"${match.group(0)}", match.end()  # unset: kept as written, for the caller to name
        return (" ".join(value) if isinstance(value, list) else value), match.end()

    def _parameter(self, inner: str) -> str | list[str]:
        """``${...}``: a variable, an array item or all items, a length, a default, a pattern removal."""
        if inner.startswith("#"):  # a length: of a string, or of an array with [@]
            return str(len(self._parameter(inner[1:])))
        match = re.match(r"([A-Za-z_]\w*|\d+|[@*])(\[([^\]]*)\])?(.*)$", inner, re.S)
        if match is None:
            return "${" + inner + "}"
        name, index, rest = match.group(1), match.group(3), match.group(4)
        value: str | list[str] | None = [] if name in "@*" else self._get(name)
        if index is not None and value is not None:
            items = value if isinstance(value, list) else [value]
            if index in ("@", "*"):
                value = items
            else:
                position = int(self.arithmetic(index, index) or 0)
                value = items[position] if -len(items) <= position < len(items) else None
        elif isinstance(value, list):
            value = value[0] if value else ""
        op = re.match(r"(:?[-=+?]|##?|%%?)(.*)$", rest, re.S) if rest else None
        if op is None:
            return value if value is not None else "$" + inner  # unset: kept as written, for the caller to name
        kind, arg = op.group(1), op.group(2)
        empty = value is None or (kind.startswith(":") and value in ("", []))
        if kind in (":-", "-", ":=", "="):
            if empty:
                value = " ".join(w.text for w in self._expand_all(arg))
                if "=" in kind:
                    self.vars[name] = value
            return value if value is not None else ""
        if kind in (":+", "+"):
            return "" if empty else " ".join(w.text for w in self._expand_all(arg))
        if kind in (":?", "?"):
            return value if value is not None else "${" + inner + "}"
        if value is None or isinstance(value, list):
            return "${" + inner + "}"
        pattern = " ".join(w.text for w in self._expand_all(arg))
        return self._remove(value, pattern, kind)

    @staticmethod
    def _remove(value: str, pattern: str, kind: str) -> str:
        """``${v#p}``, ``${v##p}``, ``${v%p}``, ``${v%%p}``: the shortest / longest match of `pattern` removed."""
        cuts = range(len(value) + 1) if kind in ("#", "%") else range(len(value), -1, -1)
        for k in cuts:
            if kind.startswith("#") and fnmatch.fnmatchcase(value[:k], pattern):
                return value[k:]
            if kind.startswith("%") and fnmatch.fnmatchcase(value[len(value) - k:], pattern):
                return value[:len(value) - k]
        return value

    def _expand_all(self, raw: str) -> list[Word]:
        used = self.used
        words = [w for part in lex(raw) for word in part.words for w in self.expand(word)] if raw.strip() else []
        self.used = used | {s for w in words for s in w.secrets}
        return words

    def arithmetic(self, expr: str, written: str) -> str:
        """``$((expr))``: integers only; names are variables (unset = 0), as in bash."""
        text = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", expr)

        def value(node: ast.AST) -> int:
            if isinstance(node, ast.Expression):
                return value(node.body)
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.Name):
                raw = self._get(node.id)
                return int(raw) if isinstance(raw, str) and raw.strip().lstrip("-").isdigit() else 0
            if isinstance(node, ast.BinOp) and type(node.op) in ARITH:
                return int(ARITH[type(node.op)](value(node.left), value(node.right)))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
                return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
            raise ValueError(written)

        try:
            return str(value(ast.parse(text.strip(), mode="eval")))
        except (SyntaxError, ValueError, ZeroDivisionError):
            self.notes.append(f"{written}: arithmetic hybridflow migrate cannot work out; left as written")
            return written

    def _substitute(self, body: str, written: str) -> str:
        """``$(...)``: the few path commands computed here (module docstring); anything else is left as written."""
        parts = lex(body)
        words = [w.text for w in self.expand_command(parts[-1].words)] if parts else []
        cd = [self.expand_command(p.words) for p in parts[:-1]]
        base = self.workdir
        if cd and all(c and c[0].text == "cd" for c in cd):
            target = [w.text for w in cd[-1][1:] if w.text != "--"]
            base = Path(os.path.normpath(base / target[0])) if target else base
        elif cd:
            words = []
        if words == ["pwd"]:
            return str(base)
        if words[:1] in (["dirname"], ["basename"], ["realpath"], ["echo"]) and len(words) >= 2 or \
                words[:2] == ["readlink", "-f"] and len(words) == 3:
            arg = words[-1]
            if words[0] == "dirname":
                return os.path.dirname(arg) or "."
            if words[0] == "basename":
                name = os.path.basename(words[1].rstrip("/"))
                return name[:-len(words[2])] if len(words) == 3 and name.endswith(words[2]) else name
            if words[0] == "echo":
                return " ".join(words[1:])
            return os.path.normpath(base / arg)
        what = "a function of the script" if words[:1] and words[0] in self.functions else "a command"
        self.notes.append(f"{written}: {what} hybridflow migrate does not run; left as written")
        return written

    def expand_command(self, raws: list[str]) -> list[Word]:
        """The fields of a command's raw words."""
        return [w for raw in raws for w in self.expand(raw)]



def _split(value: str) -> list[str]:
    """An unquoted expansion's fields: split on whitespace, but a substitution left as written (``$(date +%s)``)
    stays one field."""
    fields, depth, current = [], 0, ""
    for i, c in enumerate(value):
        if c == "(" and value[i - 1:i] == "$" or c == "(" and depth:
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        if c.isspace() and not depth:
            if current:
                fields.append(current)
            current = ""
        else:
            current += c
    return fields + [current] if current else fields

