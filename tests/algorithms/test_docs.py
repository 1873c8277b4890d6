"""The Python snippets of docs/algorithms.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

from hybridflow.algorithms import ADV_ESTIMATORS, POLICY_LOSSES

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_doc_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3
    before = (set(ADV_ESTIMATORS), set(POLICY_LOSSES))
    try:
        for block in blocks[1:]:  # the first needs a trainer's `cfg` and `batch`
            scope: dict = {}
            exec(compile(block, str(DOC), "exec"), scope)
        assert scope["loss"].item() == -0.75
        assert scope["adv"].tolist() == [[0.5, 0.5], [-0.5, -0.5]]
    finally:
        for name in set(ADV_ESTIMATORS) - before[0]:
            ADV_ESTIMATORS.unregister(name)
        for name in set(POLICY_LOSSES) - before[1]:
            POLICY_LOSSES.unregister(name)
