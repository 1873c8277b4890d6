"""Token-level records of a training step's rows, for the live run page (`hybridflow view`).

`rollout_records(batch, tokenizer, rows, version)` turns the first `rows` rows of a step's batch (rows are
laid out group by group, so these are one prompt's samples, whose advantages compare) into JSON-able dicts
that the jsonl logger appends to `rollouts.jsonl`:

    {"uid", "data_source", "score", "prompt", "version",
     "tokens":    [text of each response token],
     "trained":   [1 where the token is the model's own (trained), 0 for a tool or environment message],
     "logprob":   [the rollout engine's log-prob of each token]               (absent when not recorded)
     "old_logprob": [the trainer's log-prob of the same token before the update] (absent when skipped)
     "advantage": [each token's advantage]                                     (absent before advantages)
     "staleness": [policy updates between the weights that sampled the token and `version`] (partial rollouts)}

Segments of equal `trained` are the turns of a multi-turn trajectory: the model's (tool calls included, as
text) and the environment's or tools' answers. Padding after the response is dropped.
"""

from __future__ import annotations

from typing import Any

from hybridflow.batch import Batch

# per-token float arrays copied when the batch has them: record name -> batch key
TOKEN_FLOATS = {"logprob": "rollout_log_probs", "old_logprob": "old_log_probs", "advantage": "advantages"}


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):  # chat messages: show the last user turn, as a reader would look for it
        contents = [m.get("content", "") for m in value if isinstance(m, dict)]
        return str(contents[-1]) if contents else ""
    return str(value)


def rollout_records(batch: Batch, tokenizer: Any, rows: int, version: int) -> list[dict[str, Any]]:
    """The first `rows` rows of `batch` as token-level records (see the module docstring); `version` is the
    policy version the step trains (the staleness of a token is `version` minus the version that sampled it)."""
    count = min(rows, len(batch))
    if count <= 0:
        return []
    responses = batch["responses"][:count]
    width = responses.shape[1]
    lengths = batch["attention_mask"][:count, -width:].sum(dim=-1).tolist()
    mask = batch["response_mask"][:count]
    records = []
    for i in range(count):
        n = int(lengths[i])
        ids = responses[i, :n].tolist()
        record: dict[str, Any] = {
            "uid": str(batch["uid"][i]) if "uid" in batch else str(i),
            "data_source": str(batch["data_source"][i]) if "data_source" in batch else "",
            "score": float(batch["score"][i]) if "score" in batch else None,
            "prompt": _text(batch["raw_prompt"][i]) if "raw_prompt" in batch else "",
            "version": int(version),
            "tokens": tokenizer.batch_decode([[t] for t in ids]),
            "trained": [int(v > 0) for v in mask[i, :n].tolist()],
        }
        for name, key in TOKEN_FLOATS.items():
            if key in batch:
                record[name] = [round(float(v), 5) for v in batch[key][i, :n].tolist()]
        if "rollout_versions" in batch:
            record["staleness"] = [int(version - v) for v in batch["rollout_versions"][i, :n].tolist()]
        records.append(record)
    return records
