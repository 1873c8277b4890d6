"""Row layouts for the training forward: padded rows, or rows packed into one sequence.

Both layouts answer the same question: for each real response token `(b, t)` of a batch with prompt
width `P` and response width `R`, which output position of the model predicts it (logits at position
`i` predict token `i + 1`) and which token id is the target. The forward pass gathers only those
positions (`logits_to_keep`), so the lm-head never runs over prompt tokens or padding.

Packed layout: the real tokens of all rows (`attention_mask == 1`) are concatenated into `[1, T]`, each
row keeping its own position ids; ``cu_seq_lens_q`` marks the row starts for varlen attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a host-device sync: a copy from pageable host memory to a GPU waits for
    the GPU's queue to drain (a bubble in every micro-batch), one from pinned memory does not."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass
class ModelInputs:
    """What one forward needs: model kwargs, and where the response tokens sit in its output.

    `kwargs`: input_ids / attention_mask / position_ids (and cu_seq_lens for packing) for the model.
    `positions`: long `[K]` positions in the model's full output, flattened over its batch and sequence
    dims (`[B * (P+R)]` padded, `[T]` packed), whose outputs predict the `K` real response tokens.
    `targets`: long `[K]` those tokens' ids. `scatter`: long `[K]` flat indices into `[B * R]` where
    each result goes. `packed`: the layout. `num_tokens`: real tokens in the forward.
    """

    kwargs: dict
    positions: torch.Tensor
    targets: torch.Tensor
    scatter: torch.Tensor
    rows: int
    response_width: int
    packed: bool
    num_tokens: int

    def to(self, device: torch.device) -> ModelInputs:
        """The same inputs with every tensor on `device`."""
        move = lambda v: to_device(v, device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return ModelInputs({k: move(v) for k, v in self.kwargs.items()}, move(self.positions),
                           move(self.targets), move(self.scatter), self.rows, self.response_width, self.packed,
                           self.num_tokens)

    def lm_keep(self) -> tuple[int | torch.Tensor, torch.Tensor | None]:
        """(`logits_to_keep` for a causal-LM call, index `[K]` into its flattened `[*, V]` logits, or
        None when the kept logits are already exactly the `K` wanted rows in order).

        Packed: keep exactly the `K` positions. Padded (one index set for all rows): keep the last
        `R + 1` positions of every row, then pick the response ones.
        """
        if self.packed:
            return self.positions, None
        width = self.kwargs["input_ids"].shape[1]
        kept = self.response_width + 1
        b, pos = self.positions // width, self.positions % width
        return kept, b * kept + pos - (width - kept)

    def unflatten(self, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[K, ...]` per-response-token values -> `[B, R, ...]` in `dtype`, zero where no real token is."""
        out = values.new_zeros(self.rows * self.response_width, *values.shape[1:], dtype=dtype)
        out[self.scatter] = values.to(dtype)
        return out.view(self.rows, self.response_width, *values.shape[1:])

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """`[B, R, ...]` values laid out like the response -> `[K, ...]` at the real response tokens, in the
        order of `targets` (`unflatten`'s inverse)."""
        return values.reshape(self.rows * self.response_width, *values.shape[2:])[self.scatter]


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                 position_ids: torch.Tensor | None = None, pack: bool = True) -> ModelInputs:
    """Model inputs for rows `input_ids` `[B, P+R]` whose last `response_width` columns are the response.

    Real response tokens are those with `attention_mask == 1` among the last `R` columns; each needs a
    real token right before it (the last prompt token or the previous response token).
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must have the same shape [B, P+R]")
    rows, width = input_ids.shape
    prompt_width = width - response_width
    if prompt_width < 1:
        raise ValueError(f"response width {response_width} leaves no prompt column in rows of {width}")
    mask = attention_mask.bool()
    if position_ids is None:
        position_ids = _position_ids(attention_mask)
    resp_mask = mask[:, prompt_width:]
    before = mask[:, prompt_width - 1:-1]
    bad = resp_mask & ~before
    if bad.any():
        b, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"row {b}: response token {t} has no real token before it "
                         "(empty prompt, or a hole in attention_mask)")
    b_idx, t_idx = resp_mask.nonzero(as_tuple=True)
    targets = input_ids[b_idx, prompt_width + t_idx]
    scatter = b_idx * response_width + t_idx
    if pack:
        flat_pos = mask.view(-1).long().cumsum(0) - 1  # packed index of every real token
        positions = flat_pos.view(rows, width)[b_idx, prompt_width + t_idx - 1]
        lengths = mask.sum(-1).to(torch.int32)
        cu = torch.zeros(rows + 1, dtype=torch.int32, device=input_ids.device)
        cu[1:] = lengths.cumsum(0)
        max_len = int(lengths.max()) if rows else 0
        kwargs = dict(input_ids=input_ids[mask].unsqueeze(0), position_ids=position_ids[mask].unsqueeze(0),
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        num_tokens = int(cu[-1])
    else:
        positions = b_idx * width + prompt_width + t_idx - 1
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        num_tokens = int(mask.sum())
    return ModelInputs(kwargs, positions, targets, scatter, rows, response_width, pack, num_tokens)
