"""Writes docs/config.md from the config schema; `--check` exits 1 when the file is stale.

    python scripts/gen_config_docs.py           # regenerate
    python scripts/gen_config_docs.py --check   # CI: is docs/config.md up to date?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.config.config_docs import render_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args()
    text = render_reference()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale; run: python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
