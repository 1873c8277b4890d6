"""`ModelReward`: a sequence-classification model (a reward model) that scores prompt + response text.

The model is any local Hugging Face directory that ``AutoModelForSequenceClassification`` loads
(Qwen2/Llama-style reward models, ``num_labels=1``; with more labels pick one by `label_index`). It is a
plain class, so it lives wherever the trainer puts it: in the controller for tiny models, or inside a
worker of its own group (a role class in ``hybridflow/workers/`` holds a `ModelReward` and exposes
``score`` as a dispatched method, so the reward model gets its own devices)::

    rm = ModelReward("/models/rm", device="cuda", dtype="bfloat16")
    texts = rm.format_texts(prompts, responses)   # chat template on message prompts
    scores = rm.score(texts)                      # list[float], one per text

Texts are right-padded (positions of real tokens do not depend on the batch) and truncated from the
left to `max_length`, so the end of the response, where the reward is read, is always kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.data.chat import render_scored_text

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelReward:
    """Scores texts with a sequence-classification model.

    Args:
        path: local model directory.
        tokenizer_path: tokenizer directory (default: `path`).
        device: ``cpu``, ``cuda``, ``cuda:1``...
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        batch_size: texts per forward pass.
        max_length: longest tokenized text; longer texts keep their last `max_length` tokens.
        label_index: which logit is the reward (models with ``num_labels > 1``).
    """

    def __init__(self, path: str, tokenizer_path: str | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 16, max_length: int = 2048, label_index: int = 0) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"reward model dtype {dtype!r} is unknown; valid: {', '.join(_DTYPES)}")
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=_DTYPES[dtype]).to(device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        num_labels = self.model.config.num_labels
        if not 0 <= label_index < num_labels:
            raise ValueError(f"label_index {label_index} is out of range for a model with {num_labels} labels")
        self.device, self.batch_size, self.max_length, self.label_index = device, batch_size, max_length, label_index

    def format_texts(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[str]:
        """Prompt + response texts: chat-message prompts go through the tokenizer's chat template with
        the response as the assistant turn; string prompts are concatenated with the response."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [render_scored_text(prompt, response, self.tokenizer) for prompt, response in zip(prompts, responses)]

    @torch.no_grad()
    def score(self, texts: Sequence[str]) -> list[float]:
        """One float reward per text (the model's `label_index` logit at the last real token)."""
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(list(texts[start:start + self.batch_size]), return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length, add_special_tokens=False)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            logits = self.model(**enc).logits  # [b, num_labels]
            scores.extend(logits[:, self.label_index].float().cpu().tolist())
        return scores
