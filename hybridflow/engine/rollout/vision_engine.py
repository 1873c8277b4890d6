"""`VisionRolloutEngine`: generation for vision-language models (Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5, SmolVLM) with
images in the prompts.

    engine = VisionRolloutEngine(path, device, dtype, stop_ids, max_num_seqs=64, max_model_len=2048)
    outs = engine.generate(prompt_token_ids, SamplingParams(n=8), vision=[VisionInputs, ...])

Each prompt's token ids already hold its vision tokens (`hybridflow.data.image_prompts`); `vision[i]` holds its pixel values
and patch grids (None for a prompt without images). What differs by family (the image tokens, the pixels' layout,
the positions and masks of the prefill) is `data.vision_family`'s.

The prefill runs in the model's own transformers modules, the decode on the fast engine (`vision_lm`):

- **Prefill**, once per prompt, as many prompts at a time as have free KV slots for their n samples (within
  `max_prefill_tokens` padded tokens; once an eighth of the slots is free, as the fast scheduler admits): one
  forward of the transformers model over the left-padded prompts, where the vision tower encodes each prompt's
  images once and their embeddings take the place of the image tokens. Qwen's take the multimodal rotary positions
  (mrope) of `get_rope_index` (an image's tokens take temporal / height / width positions, text after it continues
  from the largest); Gemma 3's take plain positions and `token_type_ids`, with which an image's tokens attend to
  each other both ways; SmolVLM's plain positions, the tower encoding each image's tiles. The forward keeps every
  position's K/V, a sliding-window layer's too (transformers' own cache for Gemma 3 would keep only the window): the
  fast engine's cache holds every position.
- **Hand-off**: each prompt's K/V, already rotated by those positions, go from transformers' cache into the fast
  engine's slots of its n samples (`vision_lm.write_prompts`; Qwen3.5's linear-attention layers: their conv and
  recurrent states after the prompt's last token, `write_states`), and the samples' first tokens are drawn from the
  prompt's last logits (`Session.place`).
- **Decode**: the fast engine's, with continuous batching (a finished row's slot takes the next waiting prompt), CUDA
  graphs and its sampler. A generated token's three mrope components all equal `its index + the prompt's rope
  delta`, so its rotation is the text family's plain rope at that position: each row's rotary position is shifted
  by its prompt's delta (`RunningBatch.rope_offsets`), its cache position stays its index. Gemma 3 and SmolVLM have
  no delta.

The language model is the fast decoder's Qwen2 (Qwen2.5-VL), Qwen3 (Qwen3-VL), Gemma 3 text model (its sliding and
global layers, `gemma3.py`), Qwen3.5 text model (`hybrid_decoder.py`) or Llama (SmolVLM) over one copy of the weights
(`vision_lm.SharedWeights`), so `load_weights` (HF names, into the transformers model in place) reaches the decode
too, and `sleep` / `wake` free and re-make the fast engine's KV cache (with offload, every weight to the CPU and back,
still one copy). The image and video placeholder tokens are never drawn (sampled into a response, the trainer's
forward would take one for an image position); the log-probs stay the policy's over every token, as the trainer
computes them (`sampler.sample`'s `never`). Greedy output equals `transformers.generate` on the same prompts and
images, for every family, with prompts joining as slots free (tests/engine/vision/test_vision_rollout.py).
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

from hybridflow.data.image_prompts import VisionInputs
from hybridflow.data.vision_family import vision_family
from hybridflow.engine.rollout.engine import MAX_PREFILL_TOKENS, RolloutEngine
from hybridflow.engine.rollout.hf_fallback import HFRolloutEngine
from hybridflow.engine.rollout.recurrent_state import StateCache
from hybridflow.engine.rollout.session import Session
from hybridflow.engine.rollout.types import Completion, SamplingParams, check_prompts
from hybridflow.engine.rollout.vision_lm import SharedWeights, write_prompts


class VisionRolloutEngine(HFRolloutEngine):
    """A transformers vision-language model behind the rollout engine's interface, images given per prompt."""

    kind = "vision"
    auto_class = "AutoModelForImageTextToText"
    path_name = "the transformers model's prefill and the fast engine's decode (VisionRolloutEngine)"
    slow_path = False

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype, stop_ids: list[int],
                 max_num_seqs: int, max_model_len: int, kv_cache_memory: float | int | None = None,
                 cuda_graphs: bool = True, max_prefill_tokens: int = MAX_PREFILL_TOKENS) -> None:
        """kv_cache_memory, cuda_graphs: the fast engine's (`RolloutEngine.from_pretrained`); max_prefill_tokens: the
        padded prompt tokens (prompts x the longest) one prefill forward takes, where more than one prompt waits."""
        super().__init__(path, device, dtype, stop_ids, max_num_seqs, max_model_len)
        text = self.config.get_text_config()  # a VLM config keeps the language model's sizes in its text config
        self.max_model_len = min(self.max_model_len, text.max_position_embeddings)
        self.max_prefill_tokens = max_prefill_tokens
        self.family = vision_family(self.config)
        self.image_token_id = self.family.image_token_id
        self.vocab_size = int(text.vocab_size)
        self.weights = SharedWeights.build(self.model, self.max_model_len)
        # never sampled: a response's image or video placeholder would be taken for an image position by the
        # trainer's forward (its features scattered there, its rotary index shifted) and fail the update
        self.fast = RolloutEngine(self.weights.fast, device, dtype, stop_ids, max_num_seqs, self.max_model_len,
                                  kv_cache_memory, cuda_graphs, max_prefill_tokens, rope_offsets=self.family.rope_delta,
                                  never_sample=[t for t in self.family.placeholders if t < self.vocab_size])
        self.max_num_seqs = self.fast.kv.num_slots  # the KV budget may hold fewer rows than asked for
        self.encoded_images = 0  # images the vision tower has encoded (tests: once per prompt, not per sample)
        # the prefill's cache: without the config's layer types (full layers, so a sliding-window layer keeps every
        # position too), but a hybrid model's (Qwen3.5: no sliding layers), whose states the hand-off copies into the
        # fast engine's state cache, from its text config, which gives its linear layers state layers
        self.prefill_cache_config = text if isinstance(self.fast.kv, StateCache) else None
        # `past_key_values` until a transformers 5.x release renamed it `cache` (the old name an alias until 5.40): the
        # GPU machine's 5.x takes only the old one, and a name a forward does not take would be dropped silently
        self.cache_keyword = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"

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
        if params.n > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds the engine's {self.max_num_seqs} KV slots; build "
                             f"it with max_num_seqs >= n")
        self.fast.weight_version = self.weight_version  # its owner sets ours; the fast engine records the tokens
        session = self.fast.session(params)
        waiting = deque(range(len(prompt_token_ids)))
        seqs: list[list[int]] = [[] for _ in prompt_token_ids]
        done: dict[int, Completion] = {}
        start_s = time.perf_counter()
        while waiting or session.has_work:
            chunk = self._admit(waiting, prompt_token_ids, session, params.n)
            if not chunk:
                done.update(session.step())
                continue
            placed = self._start(session, [prompt_token_ids[i] for i in chunk], [vision[i] for i in chunk], params.n)
            for i, ids in zip(chunk, placed):
                seqs[i] = ids
        outs = [[done[seq] for seq in row] for row in seqs]
        self.report_rate(outs, start_s)
        return outs

    def _admit(self, waiting: deque[int], prompts: list[list[int]], session: Session, n: int) -> list[int]:
        """The waiting prompts to prefill now (popped): as many as have n free slots each and fit one prefill of
        `max_prefill_tokens` padded tokens, once they fill an eighth of the slots (or all that wait, or nothing
        runs), as the fast engine's scheduler admits; [] to decode instead."""
        fit = min(len(waiting), session.free_slots // n)
        width = count = 0
        while count < fit:
            width = max(width, len(prompts[waiting[count]]))
            if count and (count + 1) * width > self.max_prefill_tokens:
                break
            count += 1
        wanted = min(session.scheduler.admit_batch, len(waiting) * n)
        if not count or (count * n < wanted and len(session.batch)):
            return []
        return [waiting.popleft() for _ in range(count)]

    def _start(self, session: Session, prompts: list[list[int]], vision: list[VisionInputs | None],
               n: int) -> list[list[int]]:
        """Prefill the prompts through the transformers modules, draw their samples' first tokens and hand their
        K/V to the fast engine's slots; the sequence ids of each prompt's samples."""
        logits, cache, deltas = self._prefill(prompts, vision)
        lengths = [len(p) for p in prompts]
        offsets = [int(d) for d in deltas.tolist()]
        for length, delta in zip(lengths, offsets):
            if delta > 0:  # images only ever lower a prompt's largest position below its length
                raise ValueError(f"a prompt of {length} tokens has rope delta {delta} > 0 (video timestamps?); the "
                                 f"fast decode's rotary table holds positions up to max_model_len only")
        placed = session.place(lengths, n, logits, offsets)
        write_prompts(self.fast.kv, cache, lengths, [slots for _, slots in placed])
        return [ids for ids, _ in placed]

    def _check_image_tokens(self, i: int, prompt: list[int], images: VisionInputs | None) -> None:
        """ValueError when prompt i's image tokens are not as many as its images take."""
        have = sum(1 for t in prompt if t == self.image_token_id)
        want = self.family.token_count(images)
        if have != want:
            raise ValueError(f"prompt {i} has {have} image tokens (id {self.image_token_id}) but its images make "
                             f"{want}; encode prompts and images together (hybridflow.data.image_prompts.VisionPrompts)")

    def _prefill(self, prompts: list[list[int]], vision: list[VisionInputs | None]):
        """One forward over the left-padded prompts and their images -> (last logits [B, V], transformers' KV cache
        of every position, rope deltas [B])."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        present = [v for v in vision if v is not None]
        images = VisionInputs.concat(present).to(self.device, self.model.dtype) if present else None
        kwargs, deltas = self.family.forward_kwargs(self.model, ids, mask, images)
        cache = DynamicCache(config=self.prefill_cache_config) if self.prefill_cache_config is not None \
            else DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                         **{self.cache_keyword: cache}, **kwargs)
        self.encoded_images += 0 if images is None else len(images.image_grid_thw)
        return out.logits[:, -1], cache, deltas

    # ---- weights and memory: one copy of the language model, two sets of modules over it (`vision_lm`) ---------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the transformers model in place, which the fast engine's weights share."""
        if self.fast.weights_offloaded:
            self.fast.load_weights(())  # brings its offloaded weights back, as a load into it would
            self._follow_fast()
        return super().load_weights(named_tensors)

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the fast engine's KV cache; with offload_weights, move every weight to the CPU."""
        self.fast.sleep(offload_weights)
        if offload_weights:
            self._follow_fast()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.fast.weights_offloaded:
            self.fast.load_weights(())
            self._follow_fast()
        self.fast.wake()

    def _follow_fast(self) -> None:
        """After the fast engine moved its weights: the transformers model's views follow its fused projections, the
        model moves the rest (its tower, the tensors the fast model holds) to where they went, and the fast model
        holds those moved tensors again; still one copy."""
        self.weights.views_into_fast()
        self.model.to("cpu" if self.fast.weights_offloaded else self.device)
        self.weights.fast_holds_hf()
