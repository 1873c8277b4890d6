"""`VisionRolloutEngine`: generation for vision-language models (Qwen2.5-VL, Qwen3-VL) with images in the prompts.

    engine = VisionRolloutEngine(path, device, dtype, stop_ids, max_num_seqs=64, max_model_len=2048)
    outs = engine.generate(prompt_token_ids, SamplingParams(n=8), vision=[VisionInputs, ...])

Each prompt's token ids already hold its vision tokens (`hybridflow.data.image_prompts`); `vision[i]` holds its pixel values
and patch grids (None for a prompt without images). Prompts run in left-padded chunks of up to max_num_seqs rows
(prompts x n). A chunk is prefilled once: one forward of the transformers model over its prompts, where the vision
tower encodes each prompt's images once and their embeddings take the place of the image tokens; the KV cache and
the last position's logits are then repeated for the n samples of each prompt, so the samples share the prompt's
one encoding and prefill. Decoding feeds one token per row over that cache with the multimodal rotary positions
(mrope) of Qwen2.5-VL and Qwen3-VL: the prompt's positions come from the model's `get_rope_index` (an image's tokens take
temporal / height / width positions, text after it continues from the largest), and a generated token's three
position components are all `its index + the prompt's rope delta`. Tokens are drawn by the fast engine's sampler
(`sampler.sample`), so log-probs and greedy ties follow the same rules, except that the image and video placeholder
tokens are never drawn (sampled into a response, the trainer's forward would take one for an image position); the
log-probs stay the policy's over every token, as the trainer computes them. Greedy output equals
`transformers.generate` on the same prompt and image, for both families (tests/engine/vision/test_vision_rollout.py).

This is a correct path through the model's own modules, not our fused decoder: no varlen prefill, CUDA graphs or
continuous batching (a chunk decodes until its last row stops). It inherits weight loading and sleep / wake from
`HFRolloutEngine`, and its warning that generation runs on the slow path.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hybridflow.data.image_prompts import VisionInputs
from hybridflow.engine.rollout.hf_fallback import HFRolloutEngine
from hybridflow.engine.rollout.sampler import log_probs_of, sample
from hybridflow.engine.rollout.types import Completion, SamplingParams, check_prompts


class VisionRolloutEngine(HFRolloutEngine):
    """A transformers vision-language model behind the rollout engine's interface, images given per prompt."""

    kind = "vision"
    auto_class = "AutoModelForImageTextToText"
    path_name = "the transformers model's own modules (VisionRolloutEngine)"

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype, stop_ids: list[int],
                 max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(path, device, dtype, stop_ids, max_num_seqs, max_model_len,
                         why="a vision-language model has no path in the fast engine")
        text = self.config.get_text_config()  # a VLM config keeps the language model's sizes in its text config
        self.max_model_len = min(self.max_model_len, text.max_position_embeddings)
        self.image_token_id = int(self.config.image_token_id)
        self.vocab_size = int(text.vocab_size)
        # never sampled: a response's image or video placeholder would be taken for an image position by the
        # trainer's forward (its features scattered there, its rotary index shifted) and fail the update
        placeholders = {self.image_token_id, int(getattr(self.config, "video_token_id", self.image_token_id))}
        self.placeholders = torch.tensor(sorted(t for t in placeholders if t < self.vocab_size), device=self.device)
        self.encoded_images = 0  # images the vision tower has encoded (tests: once per prompt, not per sample)

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams | None = None,
                 vision: list[VisionInputs | None] | None = None) -> list[list[Completion]]:
        """outs[i][j]: the j-th of `params.n` samples for prompt i, whose images are `vision[i]`."""
        params = params or SamplingParams()
        check_prompts(prompt_token_ids, self.max_model_len, self.vocab_size)
        vision = vision if vision is not None else [None] * len(prompt_token_ids)
        if len(vision) != len(prompt_token_ids):
            raise ValueError(f"{len(vision)} vision inputs for {len(prompt_token_ids)} prompts; give one (or None) "
                             f"per prompt")
        for i, (prompt, images) in enumerate(zip(prompt_token_ids, vision)):
            self._check_image_tokens(i, prompt, images)
        stop_ids = self.default_stop_ids if params.stop_token_ids is None else params.stop_token_ids
        generator = torch.Generator(self.device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        per_chunk = max(1, self.max_num_seqs // params.n)
        outs: list[list[Completion]] = []
        start_s = time.perf_counter()
        for start in range(0, len(prompt_token_ids), per_chunk):
            end = start + per_chunk
            outs += self._generate_images(prompt_token_ids[start:end], vision[start:end], params, stop_ids, generator)
        self.report_rate(outs, start_s)
        return outs

    def _check_image_tokens(self, i: int, prompt: list[int], images: VisionInputs | None) -> None:
        """ValueError when prompt i's image tokens are not the merged patches of its images."""
        have = sum(1 for t in prompt if t == self.image_token_id)
        want = VisionInputs.token_count(images, self.config)
        if have != want:
            raise ValueError(f"prompt {i} has {have} image tokens (id {self.image_token_id}) but its images make "
                             f"{want}; encode prompts and images together (hybridflow.data.image_prompts.VisionPrompts)")

    def _prefill(self, prompts: list[list[int]], vision: list[VisionInputs | None]):
        """One forward over the left-padded prompts and their images -> (last logits [B, V], KV cache,
        attention mask [B, P], rope deltas [B, 1])."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        present = [v for v in vision if v is not None]
        images = VisionInputs.concat(present).to(self.device, self.model.dtype) if present else None
        grid = images.image_grid_thw if images is not None else None
        positions, deltas = self.model.model.get_rope_index(ids, (ids == self.image_token_id).int(), grid,
                                                            attention_mask=mask)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **(images.model_kwargs() if images is not None else {}))
        self.encoded_images += 0 if grid is None else len(grid)
        return out.logits[:, -1], out.past_key_values, mask, deltas

    def _generate_images(self, prompts: list[list[int]], vision: list[VisionInputs | None], params: SamplingParams,
                        stop_ids: list[int], generator: torch.Generator) -> list[list[Completion]]:
        logits, cache, mask, deltas = self._prefill(prompts, vision)
        n = params.n
        if n > 1:  # the samples of a prompt share its prefill: its cache rows repeated, nothing recomputed
            cache.batch_repeat_interleave(n)
            logits, mask, deltas = (t.repeat_interleave(n, dim=0) for t in (logits, mask, deltas))
        limits = torch.tensor([min(params.max_tokens, self.max_model_len - len(p)) for p in prompts
                               for _ in range(n)], device=self.device)
        lengths = mask.sum(-1)
        is_stop = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        stops = [t for t in stop_ids if t < self.vocab_size]
        if stops:
            is_stop[torch.tensor(stops, device=self.device)] = True
        tokens, logprobs = self._sample(logits, params, generator)
        out_tokens, out_logprobs = [tokens], [logprobs]
        done = is_stop[tokens] | (limits <= 1)
        for step in range(1, int(limits.max())):
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            # a generated token's t/h/w positions are equal: its index in the sequence shifted by the rope delta
            position = (lengths + step - 1)[:, None] + deltas
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, cache=cache,
                             position_ids=position[None].expand(3, -1, -1), use_cache=True)
            cache = out.past_key_values
            tokens, logprobs = self._sample(out.logits[:, -1], params, generator)
            out_tokens.append(tokens)
            out_logprobs.append(logprobs)
            done = done | is_stop[tokens] | (limits <= step + 1)
        return self._completions(torch.stack(out_tokens, 1), torch.stack(out_logprobs, 1), limits, is_stop, n)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A draw by the fast engine's sampler with the vision placeholders left out; the log-probs are the policy's
        own (`sample`'s over every token, what the trainer computes for the drawn ones)."""
        tokens, _ = sample(logits.index_fill(-1, self.placeholders, float("-inf")), params, generator)
        return tokens, log_probs_of(logits, tokens, params)

    def _completions(self, tokens: torch.Tensor, logprobs: torch.Tensor, limits: torch.Tensor, is_stop: torch.Tensor,
                     n: int) -> list[list[Completion]]:
        """Rows [B*n, steps] -> per prompt its n `Completion`s, each cut after its first stop token or its limit."""
        stopped = is_stop[tokens].tolist()
        token_rows, logprob_rows, limit_list = tokens.tolist(), logprobs.tolist(), limits.tolist()
        rows = []
        for r, (ids, lps, limit, stop) in enumerate(zip(token_rows, logprob_rows, limit_list, stopped)):
            end = next((k + 1 for k, s in enumerate(stop[:limit]) if s), None)
            length = end or limit
            rows.append(Completion(ids[:length], lps[:length], "stop" if end else "length",
                                   versions=[self.weight_version] * length))
        return [rows[i:i + n] for i in range(0, len(rows), n)]
