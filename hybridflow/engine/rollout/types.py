"""What a caller asks the rollout engine for (`SamplingParams`) and what it gets back (`Completion`).

`SamplingParams` validates itself on construction, so a bad value fails where it was written, with the
field, the value and what would be valid. Both the fast engine and the `transformers.generate` fallback
take and return exactly these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "suspended"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample continuations for a batch of prompts.

    n: samples per prompt; the prompt is prefilled once and its KV cache copied to the n samples.
    temperature: 0.0 is greedy (argmax); otherwise logits are divided by it before top-k / top-p.
    top_p: nucleus sampling; keep the smallest set of tokens whose probability reaches top_p (1.0: off).
    top_k: keep the k most likely tokens (-1: off).
    max_tokens: the most new tokens per sample (the context length may stop a sample earlier).
    stop_token_ids: a sample stops after emitting any of these (the stop token is kept in the output).
        None takes the model's generation config (its eos ids); [] means no stop token at all.
    seed: makes sampling reproducible for the same prompts, parameters and engine settings; None draws
        a fresh seed from torch's global generator.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; {valid}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "it must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "it must be a float >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "it must be a float in (0, 1] (1 means off)")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "it must be -1 (off) or an int >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "it must be an int >= 1")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise bad("stop_token_ids", "it must be None (the model's eos ids) or a list of ids >= 0")
            object.__setattr__(self, "stop_token_ids", list(ids))
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "it must be None or an int")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sample for one prompt.

    token_ids: the generated tokens, the stop token included when the sample stopped on one.
    logprobs: per token, its log-probability under the distribution it was sampled from: softmax of
        logits / temperature, after top-k / top-p truncation and renormalisation (without truncation
        this is exactly log_softmax(logits / temperature)); for greedy decoding, log_softmax(logits).
    finish_reason: "stop" (emitted a stop token), "length" (max_tokens or the context was reached), or
        "suspended" (taken out of its session unfinished, `Session.suspend`: the tokens so far).
    routes: with the engine's `record_routes`, int16 [L, sparse layers, k]: the experts each token the model
        was fed for this sequence went to, in the router's top-k order: the prompt's tokens (all earlier turns'
        too, for a continued sequence), then the generated ones but the last (never fed back), L of them.
    versions: per token, the engine's `weight_version` when it was sampled (the policy version that
        produced it; partial rollouts carry a sequence across weight updates).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    routes: torch.Tensor | None = None
    versions: list[int] = field(default_factory=list)


def check_prompts(prompt_token_ids: list[list[int]], max_model_len: int, vocab_size: int,
                  longer: str = "build the engine with a larger max_model_len") -> None:
    """Raise ValueError naming the first bad prompt: not a list of ints, empty, out of vocabulary, or
    too long to leave room for one new token in a context of `max_model_len` tokens (the message then says how to
    make the context `longer`)."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of lists of token ids, got "
                         f"{type(prompt_token_ids).__name__}")
    for i, prompt in enumerate(prompt_token_ids):
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {prompt!r:.80}")
        if len(prompt) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens but the context holds max_model_len="
                             f"{max_model_len} tokens (prompt plus at least one new token); shorten it "
                             f"or {longer}")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"prompt {i} has token id {low if low < 0 else high} outside the "
                             f"vocabulary [0, {vocab_size})")
