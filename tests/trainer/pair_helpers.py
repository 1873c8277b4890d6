"""Preference pairs for the `hybridflow dpo` / `hybridflow rm` tests."""

from __future__ import annotations

import json
import random


def write_pairs(path, n: int, seed: int, conversational: bool = True, keys=("prompt", "chosen", "rejected")):
    """`n` preference pairs a tiny model can learn: the chosen completion is a word of letters a-m, the rejected
    one a word of letters n-z, whatever the prompt (a random word to repeat)."""
    rng = random.Random(seed)

    def word(letters):
        return "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))

    rows = []
    for _ in range(n):
        prompt = f"say {word('abcdefghijklmnopqrstuvwxyz')}"
        chosen, rejected = word("abcdefghijklm"), word("nopqrstuvwxyz")
        if conversational:
            prompt = [{"role": "user", "content": prompt}]
            chosen, rejected = ([{"role": "assistant", "content": c}] for c in (chosen, rejected))
        rows.append(dict(zip(keys, (prompt, chosen, rejected))))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
