"""Lets worker tests reuse the engine tests' helpers (batches, forked gloo ranks)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "train"))
