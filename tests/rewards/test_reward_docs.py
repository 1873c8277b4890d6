"""The Python snippets of docs/rewards.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

from hybridflow.rewards import REWARD_FUNCTIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def test_doc_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 5
    before = set(REWARD_FUNCTIONS)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), scope)
    assert scope["compute_score"]("d", "it is 7", 7, None) == {"score": 1.0, "correct": True, "length": 7}
    assert set(REWARD_FUNCTIONS) == before
