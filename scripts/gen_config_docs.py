"""Writes the generated configuration references: docs/config.md (`render_reference()`, the RL schema) and the
reference blocks of docs/sft.md and docs/preference.md (`render_sections` of their schemas, each from the first
"## `model`" after its "## Configuration reference" heading to the next such heading or the end of the file).
`--check` exits 1 when any of them is stale.

    python scripts/gen_config_docs.py           # regenerate
    python scripts/gen_config_docs.py --check   # is every reference up to date?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.config.config_docs import render_reference, render_sections
from hybridflow.config.preference_schema import DPOConfig, RewardModelTrainConfig
from hybridflow.config.sft_schema import SFTConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADING = "## Configuration reference"
# file -> the schema of each of its reference blocks, in the order of their headings
BLOCKS = {"sft.md": (SFTConfig,), "preference.md": (DPOConfig, RewardModelTrainConfig)}


def with_blocks(text: str, schemas: tuple[type, ...], name: str) -> str:
    """`text` with the block under each "## Configuration reference" heading replaced by its schema's sections."""
    parts = text.split(HEADING)
    if len(parts) != len(schemas) + 1:
        raise SystemExit(f"docs/{name}: {len(parts) - 1} '{HEADING}' headings, expected {len(schemas)}")
    for i, schema in enumerate(schemas, start=1):
        start = parts[i].find("\n## `model`")
        if start < 0:
            raise SystemExit(f"docs/{name}: no '## `model`' under reference heading {i}")
        tail = "\n" if i < len(schemas) else ""
        parts[i] = parts[i][:start + 1] + render_sections(schema).strip() + "\n" + tail
    return HEADING.join(parts)


def expected() -> dict[Path, str]:
    out = {DOCS / "config.md": render_reference()}
    for name, schemas in BLOCKS.items():
        out[DOCS / name] = with_blocks((DOCS / name).read_text(), schemas, name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args()
    stale = {path: text for path, text in expected().items() if not path.is_file() or path.read_text() != text}
    for path, text in stale.items():
        if args.check:
            print(f"{path} is stale; run: python scripts/gen_config_docs.py", file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
