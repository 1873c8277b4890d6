"""`HFRolloutEngine`: any architecture without a fast path, through `transformers.generate`.

Same interface and output contract as `RolloutEngine`: `generate(prompt_token_ids, SamplingParams)` ->
outs[i][j] with token_ids (stop token included), logprobs (log_softmax of the processed scores, i.e.
after temperature / top-k / top-p, as the fast sampler reports) and finish_reason; `load_weights`
copies HF-named tensors in place; `sleep` / `wake` move the model off / onto the device. Prompts run in
left-padded chunks of up to max_num_seqs rows (prompts x n).

A run on this path says so once when the engine is built (why: an architecture without a fast path, or
`rollout.engine=hf`), and once more after its first generation, with the tokens per second it reached: on one
H100 the fast engine decoded 29x `generate`'s rate at the 0.5B shape (docs/benchmarks.md). A subclass that decodes on
the fast engine (`VisionRolloutEngine`) sets `slow_path` false and says neither.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from hybridflow.engine.rollout.types import Completion, SamplingParams, check_prompts

logger = logging.getLogger(__name__)


class HFRolloutEngine:
    """`transformers.generate` behind the rollout engine's interface."""

    kind = "hf"
    auto_class = "AutoModelForCausalLM"  # the transformers Auto class that loads the model (a VLM's subclass: its own)
    path_name = "transformers.generate"  # what generates, as the warnings name it
    slow_path = True  # say so when built and after the first generation (a subclass on a fast path: False)

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype, stop_ids: list[int],
                 max_num_seqs: int, max_model_len: int, why: str = "rollout.engine=hf") -> None:
        """why: the reason this path serves (said once, in the warning the engine logs when built)."""
        import transformers

        model = getattr(transformers, self.auto_class).from_pretrained(path, dtype=dtype)
        self.model = model.to(device).eval()  # type: ignore[arg-type]  # typeshed's functools.wraps binds no self
        self.config, self.device, self.default_stop_ids = self.model.config, device, stop_ids
        positions = getattr(self.config, "max_position_embeddings", None) or getattr(self.config,
                                                                                     "n_positions", None)
        self.max_model_len = min(max_model_len, positions) if positions else max_model_len
        self.max_num_seqs = max_num_seqs
        self.weight_version = 0  # recorded with every token, as the fast engine does
        self.stats: dict[str, float] = {}
        self.rate_reported = not self.slow_path
        if self.slow_path:
            logger.warning("rollout: %s, so generation runs through %s, the slow path (the fast "
                           "engine decoded 29x its tokens per second at the 0.5B shape on one H100; "
                           "docs/models.md lists the fast architectures); its rate follows the first generation",
                           why, self.path_name)

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | None = None) -> list[list[Completion]]:
        params = params or SamplingParams()
        check_prompts(prompt_token_ids, self.max_model_len, self.config.vocab_size)
        stop_ids = self.default_stop_ids if params.stop_token_ids is None else params.stop_token_ids
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        per_chunk = max(1, self.max_num_seqs // params.n)
        outs = []
        devices = [self.device] if self.device.type == "cuda" else []
        start_s = time.perf_counter()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(prompt_token_ids), per_chunk):
                outs += self._generate_chunk(prompt_token_ids[start:start + per_chunk], params, stop_ids)
        self.report_rate(outs, start_s)
        return outs

    def report_rate(self, outs: list[list[Completion]], start_s: float) -> None:
        """Say once, after the first generation that made tokens, the rate this slow path reached."""
        tokens = sum(len(c.token_ids) for row in outs for c in row)
        if tokens and not self.rate_reported:
            self.rate_reported = True
            seconds = time.perf_counter() - start_s
            logger.warning("rollout through %s: %d tokens in %.2f s, %.0f tok/s on %s", self.path_name, tokens,
                           seconds, tokens / max(seconds, 1e-9), self.device)

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams,
                        stop_ids: list[int]) -> list[list[Completion]]:
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        pad = 0
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        limits = [min(params.max_tokens, self.max_model_len - len(p)) for p in prompts]
        sampling = {} if params.greedy else dict(temperature=params.temperature, top_p=params.top_p,
                                                 top_k=max(params.top_k, 0))
        copies = 1 if params.greedy else params.n  # greedy samples are all the same: decode once
        config = GenerationConfig(max_new_tokens=max(limits), do_sample=not params.greedy,
                                  num_return_sequences=copies, eos_token_id=stop_ids or None,
                                  pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
                                  **sampling)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        new_tokens = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)  # [rows, new, V]
        logprobs = scores.gather(-1, new_tokens[:, :scores.shape[1], None])[..., 0]
        stop = set(stop_ids)
        results = []
        for i, limit in enumerate(limits):
            row = []
            for j in range(params.n):
                r = i * copies + j % copies
                tokens = new_tokens[r, :limit].tolist()
                end = next((k + 1 for k, t in enumerate(tokens) if t in stop), None)
                tokens = tokens[:end] if end else tokens
                row.append(Completion(tokens, logprobs[r, :len(tokens)].tolist(), "stop" if end else "length",
                                      versions=[self.weight_version] * len(tokens)))
            results.append(row)
        return results

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model in place; unknown names raise KeyError. An offloaded model
        comes back to the device first, as `RolloutEngine.load_weights` does."""
        self.model.to(self.device)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        count = 0
        for name, tensor in named_tensors:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if name not in params:
                raise KeyError(f"unknown parameter {name!r} for {type(self.model).__name__}")
            params[name].copy_(tensor)
            count += 1
        return count

    def sleep(self, offload_weights: bool = False) -> None:
        """generate keeps no cache between calls; with offload_weights, move the model to CPU."""
        if offload_weights:
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        self.model.to(self.device)
