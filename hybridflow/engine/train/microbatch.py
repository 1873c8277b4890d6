"""How one rank's rows are split into mini-batches (optimizer steps) and micro-batches (forwards).

All ranks of a data-parallel group must run the same number of forwards and backwards (FSDP's
collectives pair up), even when their row counts or lengths differ. So the number of micro-batches is
agreed first (the largest any rank needs, `agree_count`), and each rank then splits its own rows into
exactly that many groups. A rank with fewer rows than groups fills the rest with empty groups, which
the engine runs as one fully masked row.

Rows that one loss reads together (a preference pair's chosen and rejected rows) stay together: with
`row_group` = k, consecutive runs of k rows are the units that are split, shuffled and budgeted.

Token budget (dynamic batch sizing): rows are grouped so no group's real-token count passes
`max_tokens` where possible (a single longer row gets a group of its own), balancing the groups by
putting each row, longest first, into the group with the fewest tokens so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridflow.engine.train.collectives import all_reduce


def agree_count(local: int, device: torch.device) -> int:
    """The largest `local` over the data-parallel ranks (just `local` without torch.distributed)."""
    return int(all_reduce(torch.tensor([local], dtype=torch.long), device, dist.ReduceOp.MAX).item())


def count_micro_batches(lengths: list[int], micro_batch_size: int | None, max_tokens: int | None) -> int:
    """How many micro-batches these rows need on their own (before agreeing with the other ranks)."""
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens_per_micro_batch must be > 0, got {max_tokens}")
        return max(1, _greedy_bins(lengths, max_tokens))
    if micro_batch_size is not None:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        return max(1, math.ceil(len(lengths) / micro_batch_size))
    return 1


def _greedy_bins(lengths: list[int], budget: int) -> int:
    """Bins a first-fit-decreasing packing of `lengths` under `budget` needs (a lower bound is the sum)."""
    bins: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, used in enumerate(bins):
            if used + n <= budget:
                bins[i] += n
                break
        else:
            bins.append(n)
    return len(bins)


def split_rows(lengths: list[int], groups: int, by_tokens: bool) -> list[list[int]]:
    """Row indices split into exactly `groups` groups (some empty if rows < groups).

    `by_tokens`: balance the groups' token sums (longest row first into the lightest group);
    otherwise contiguous groups of near-equal row counts, keeping the row order.
    """
    if groups <= 0:
        raise ValueError(f"groups must be > 0, got {groups}")
    n = len(lengths)
    if not by_tokens:
        base, extra = divmod(n, groups)
        out, start = [], 0
        for g in range(groups):
            size = base + (1 if g < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    out = [[] for _ in range(groups)]
    load = [0] * groups
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        g = min(range(groups), key=lambda g: (load[g], len(out[g])))
        out[g].append(i)
        load[g] += lengths[i]
    return [sorted(rows) for rows in out]


def group_lengths(lengths: list[int], row_group: int) -> list[int]:
    """The token count of each unit of `row_group` consecutive rows."""
    if row_group < 1 or len(lengths) % row_group:
        raise ValueError(f"{len(lengths)} rows do not divide into groups of row_group={row_group}")
    return [sum(lengths[i:i + row_group]) for i in range(0, len(lengths), row_group)]


def group_rows(units: Sequence[Sequence[int] | torch.Tensor] | torch.Tensor, row_group: int) -> list[list[int]]:
    """Unit indices -> the row indices of those units (`row_group` consecutive rows each), per part."""
    return [[int(u) * row_group + k for u in part for k in range(row_group)] for part in units]


def mini_batch_slices(rows: int, mini_batches: int, shuffle: bool, seed: int, row_group: int = 1
                      ) -> list[torch.Tensor]:
    """A (seeded) permutation of `range(rows)` cut into `mini_batches` near-equal parts; runs of `row_group`
    consecutive rows move (and stay) together."""
    units = rows // row_group
    if shuffle:
        order = torch.randperm(units, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(units)
    parts = torch.tensor_split(order, mini_batches)
    if row_group == 1:
        return list(parts)
    return [torch.tensor(part, dtype=torch.long) for part in group_rows(parts, row_group)]


def take_rows(batch: dict[str, torch.Tensor], rows: Sequence[int] | torch.Tensor,
              empty_rows: int = 1) -> dict[str, torch.Tensor]:
    """Rows `rows` of `batch`; no rows -> the first `empty_rows` rows with their responses masked out, a
    forward that adds nothing (so a rank with no rows in a micro- or mini-batch still joins the step's
    collectives)."""
    if len(rows):
        idx = torch.as_tensor(rows, dtype=torch.long)
        return {k: v[idx.to(v.device)] for k, v in batch.items()}
    out = {k: v[:empty_rows].clone() for k, v in batch.items()}
    if "response_mask" in out:
        out["response_mask"].zero_()
    return out
