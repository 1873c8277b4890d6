"""`bench/h200.sh` against the bench scripts it runs: every `--flag` a stage passes to `python3 bench/X.py` is one
X defines (in X or in a bench module X imports), and every pytest path a stage names exists. A mistyped flag
would otherwise surface only on the GPU machine, after the minutes of device time a call costs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def commands() -> list[tuple[str, str]]:
    """(script stem, its command line with continuations joined) for each `python3 bench/X.py` in h200.sh."""
    text = (BENCH / "h200.sh").read_text().replace("\\\n", " ")
    return [(m.group(1), line[m.start():]) for line in text.splitlines()
            for m in re.finditer(r"python3 bench/(\w+)\.py", line)]


def defined_flags(stem: str) -> str:
    """The source of bench/<stem>.py and of the bench modules it imports from (where shared flags live)."""
    source = (BENCH / f"{stem}.py").read_text()
    imported = re.findall(r"^from (\w+) import", source, flags=re.M)
    return source + "".join((BENCH / f"{m}.py").read_text() for m in imported if (BENCH / f"{m}.py").is_file())


def test_every_flag_a_stage_passes_is_defined_by_its_script():
    found = commands()
    assert len(found) > 20  # the stages were read
    missing = []
    for stem, line in found:
        command = line.split("|")[0].split(" 2>&1")[0]
        source = defined_flags(stem)
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command):
            if f'"{flag}"' not in source:
                missing.append(f"{stem}.py {flag}")
    assert not missing, f"h200.sh passes flags its scripts do not define: {missing}"


def test_the_test_paths_a_stage_names_exist():
    text = (BENCH / "h200.sh").read_text()
    paths = set(re.findall(r"\b(tests/[\w/]+\.py)\b", text))
    assert paths and not [p for p in paths if not (ROOT / p).is_file()]
