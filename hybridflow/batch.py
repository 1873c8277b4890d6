"""`Batch`: the row-aligned data protocol every layer passes around.

A `Batch` holds three things that travel together:

- ``tensors``: named tensors sharing their first dimension (the rows), e.g. ``input_ids [B, T]``;
- ``non_tensors``: named per-row Python objects (strings, dicts, lists...) stored as 1-D numpy
  object arrays of length ``B``;
- ``meta``: a dict that is not per-row (temperature, token counts...) and travels unchanged.

Row operations (indexing, ``chunk`` with uneven sizes, ``split``, ``concat``, ``repeat_interleave``,
``pad_to_multiple``/``unpad``) keep tensors and non-tensors in step. Pickling sends each CPU tensor
as its raw bytes (a slice never drags its parent's storage along) and rebuilds tensors on arrival.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

RowIndex = int | slice | Sequence[int] | np.ndarray | torch.Tensor

__all__ = ["Batch"]


def _to_object_array(key: str, value: Any) -> np.ndarray:
    """Turns a per-row sequence into a 1-D numpy object array (one Python object per row)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(
                f"non-tensor '{key}' must be 1-D (one entry per row), got an array of shape "
                f"{value.shape}; store a [B, ...] array as a tensor or as a list of per-row arrays"
            )
        if value.dtype == object:
            return value
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"non-tensor '{key}' must be a sequence with one entry per row (list, tuple or 1-D "
            f"numpy array), got {type(value).__name__}"
        )
    out = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        out[i] = item
    return out


def _values_equal(a: Any, b: Any) -> bool:
    """Equality for tensors, object arrays and plain values alike."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) and a.dtype == object:
        return (
            isinstance(b, np.ndarray)
            and len(a) == len(b)
            and all(_values_equal(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _tensor_state(t: torch.Tensor) -> tuple | torch.Tensor:
    """A CPU tensor as ``(dtype, shape, requires_grad, uint8 numpy view)``.

    Pickle writes the view's bytes straight into its output: a row slice costs one copy of its
    own bytes (not of its parent's storage, not an intermediate clone), and unpickling rebuilds the
    tensor on the received buffer without another copy. Device tensors are left to torch."""
    if t.device.type != "cpu":
        return t
    # contiguous_format, not .contiguous(): a one-element column slice counts as contiguous with its parent's stride
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return (t.dtype, tuple(t.shape), t.requires_grad, flat.view(torch.uint8).numpy())


def _tensor_from_state(state: tuple | torch.Tensor) -> torch.Tensor:
    if isinstance(state, torch.Tensor):
        return state
    dtype, shape, requires_grad, data = state
    return torch.from_numpy(data).view(dtype).reshape(shape).requires_grad_(requires_grad)


class Batch:
    """Named tensors, per-row non-tensors and a meta dict, all sharing the row dimension.

    Args:
        tensors: ``{key: Tensor [B, ...]}``; every tensor has the same first dimension ``B``.
        non_tensors: ``{key: sequence of B Python objects}``; stored as 1-D object arrays.
        meta: any dict; not per-row, carried unchanged through row operations.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence] | None = None,
        meta: dict | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.meta: dict = dict(meta) if meta else {}
        self._len: int | None = None
        for key, value in (tensors or {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tensor '{key}' must be a torch.Tensor, got {type(value).__name__}")
            self[key] = value
        for key, column in (non_tensors or {}).items():
            if isinstance(column, torch.Tensor):
                raise TypeError(f"non-tensor '{key}' is a torch.Tensor; pass it in `tensors`")
            self[key] = column

    @classmethod
    def _from_parts(
        cls, tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray], meta: dict, length: int
    ) -> Batch:
        """Builds a Batch from already-validated parts (no copies, no checks)."""
        out = cls.__new__(cls)
        out.tensors, out.non_tensors, out.meta, out._len = tensors, non_tensors, meta, length
        return out

    # ----------------------------------------------------------------- mapping access
    def __len__(self) -> int:
        return self._len or 0

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        """Tensor keys first, then non-tensor keys, each in insertion order."""
        return [*self.tensors, *self.non_tensors]

    def __setitem__(self, key: str, value: Any) -> None:
        """Sets a tensor (``torch.Tensor``) or a per-row non-tensor (any other sequence)."""
        if not isinstance(key, str):
            raise TypeError(f"Batch keys are strings; to assign rows build a new Batch (got {key!r})")
        if isinstance(value, torch.Tensor):
            if value.ndim == 0:
                raise ValueError(f"tensor '{key}' is 0-dimensional; put scalars in `meta`")
            stored: torch.Tensor | np.ndarray = value
        else:
            stored = _to_object_array(key, value)
        if self._len is not None and len(stored) != self._len and len(self.keys()) > (key in self):
            raise ValueError(
                f"'{key}' has {len(stored)} rows but the batch has {self._len} rows "
                f"(keys: {', '.join(self.keys())})"
            )
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(stored, torch.Tensor):
            self.tensors[key] = stored
        else:
            self.non_tensors[key] = stored
        self._len = len(stored)

    def __getitem__(self, index: str | RowIndex) -> Any:
        """``b["key"]`` returns the tensor or object array; any other index selects rows as a Batch.

        Row indices: an int (a one-row Batch), a slice, a list / numpy array / LongTensor of row
        numbers (negative allowed), or a BoolTensor / bool array mask of length ``len(b)``.
        """
        if isinstance(index, str):
            if index in self.tensors:
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise KeyError(f"no key '{index}' in batch; available: {self.keys()}")
        if isinstance(index, slice):
            rows = range(len(self))[index]
            return self._take(index, len(rows))
        idx = self._row_indices(index)
        if isinstance(index, (int, np.integer)):
            return self._take(slice(int(idx[0]), int(idx[0]) + 1), 1)
        return self._take(idx, len(idx))

    def _row_indices(self, index: RowIndex) -> np.ndarray:
        """Normalises a row index to a numpy int64 array of non-negative, in-range row numbers."""
        n = len(self)
        if isinstance(index, bool):
            raise TypeError("a bare bool is not a row index; use a mask of length len(batch)")
        if isinstance(index, (int, np.integer)):
            arr = np.array([int(index)], dtype=np.int64)
        else:
            if isinstance(index, torch.Tensor):
                index = index.detach().cpu().numpy()
            arr = np.atleast_1d(np.asarray(index))
            if arr.ndim != 1:
                raise IndexError(f"row index must be 1-D, got shape {arr.shape}")
            if arr.dtype == np.bool_:
                if len(arr) != n:
                    raise IndexError(f"boolean row mask has length {len(arr)}, batch has {n} rows")
                arr = np.flatnonzero(arr)
            elif arr.size == 0:
                arr = arr.astype(np.int64)
            elif not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"row index must hold integers or booleans, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        bad = (arr < -n) | (arr >= n)
        if bad.any():
            raise IndexError(f"row {int(arr[bad][0])} is out of range for a batch of {n} rows")
        return np.where(arr < 0, arr + n, arr)

    def _take(self, rows: slice | np.ndarray, length: int) -> Batch:
        """Selects rows from every field; `rows` is a slice (views) or an int64 array (copies)."""
        if isinstance(rows, slice):
            tensors = {k: t[rows] for k, t in self.tensors.items()}
        else:
            index_cache: dict[torch.device, torch.Tensor] = {}
            tensors = {}
            for k, t in self.tensors.items():
                if t.device not in index_cache:
                    index_cache[t.device] = torch.from_numpy(rows).to(t.device)
                tensors[k] = t.index_select(0, index_cache[t.device])
        non_tensors = {k: v[rows] for k, v in self.non_tensors.items()}
        return Batch._from_parts(tensors, non_tensors, dict(self.meta), length)

    # ----------------------------------------------------------------- key operations
    def _check_keys(self, keys: Sequence[str]) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"keys {missing} not in batch; available: {self.keys()}")

    def select(self, *keys: str) -> Batch:
        """A Batch with only `keys` (same rows, tensors shared, meta copied)."""
        self._check_keys(keys)
        tensors = {k: self.tensors[k] for k in keys if k in self.tensors}
        non_tensors = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        return Batch._from_parts(tensors, non_tensors, dict(self.meta), len(self))

    def pop(self, *keys: str) -> Batch:
        """Removes `keys` from this batch and returns them as a new Batch (meta copied)."""
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def union(self, other: Batch) -> Batch:
        """A new Batch with the keys and meta of both; shared keys must hold equal values."""
        if len(self) != len(other):
            raise ValueError(f"union needs equal lengths, got {len(self)} and {len(other)} rows")
        for key in other.keys():
            if key in self and not _values_equal(self[key], other[key]):
                raise ValueError(f"union: key '{key}' is present in both batches with different values")
        for key in other.meta.keys() & self.meta.keys():
            if not _values_equal(self.meta[key], other.meta[key]):
                raise ValueError(f"union: meta '{key}' differs ({self.meta[key]!r} vs {other.meta[key]!r})")
        return Batch._from_parts(
            {**self.tensors, **other.tensors},
            {**self.non_tensors, **other.non_tensors},
            {**self.meta, **other.meta},
            len(self),
        )

    # ----------------------------------------------------------------- row operations
    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces of the given sizes; ``sum(sizes)`` must equal ``len(self)``."""
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != len(self):
            raise ValueError(f"split sizes {sizes} must be non-negative and sum to {len(self)} rows")
        out, start = [], 0
        for size in sizes:
            out.append(self[start : start + size])
            start += size
        return out

    def chunk(self, k: int, allow_empty: bool = False) -> list[Batch]:
        """`k` consecutive pieces whose sizes differ by at most 1, earlier pieces larger.

        7 rows into 3 chunks gives sizes [3, 2, 2]. ``k > len(self)`` is refused unless
        ``allow_empty=True`` (then the last chunks are empty).
        """
        n = len(self)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"chunk count must be a positive int, got {k!r}")
        if k > n and not allow_empty:
            raise ValueError(
                f"cannot chunk {n} rows into {k} non-empty pieces; use k <= {n}, "
                f"pad first (pad_to_multiple), or pass allow_empty=True"
            )
        base, extra = divmod(n, k)
        return self.split([base + (i < extra) for i in range(k)])

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all `batches` in order; all must have the same keys. Meta comes from the first."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for key in set(first.keys()) ^ set(b.keys()):
                where = f"batch {i}" if key in first else "batch 0"
                raise KeyError(f"Batch.concat: key '{key}' is missing from {where} (keys must match)")
            for key in first.tensors:
                if key not in b.tensors:
                    raise TypeError(f"Batch.concat: '{key}' is a tensor in batch 0 but not in batch {i}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch._from_parts(tensors, non_tensors, dict(first.meta), sum(len(b) for b in batches))

    def repeat_interleave(self, n: int) -> Batch:
        """Each row `i` becomes rows ``i*n … i*n+n-1`` (for n samples per prompt)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"repeat_interleave needs a positive int, got {n!r}")
        tensors = {k: t.repeat_interleave(n, dim=0) for k, t in self.tensors.items()}
        non_tensors = {k: np.repeat(v, n) for k, v in self.non_tensors.items()}
        return Batch._from_parts(tensors, non_tensors, dict(self.meta), len(self) * n)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Appends copies of the last rows so the length divides by `k`; returns ``(batch, n_pad)``.

        With ``n_pad`` rows to add, rows ``n-n_pad … n-1`` are repeated (cycling when the batch is
        shorter than ``n_pad``). ``unpad(n_pad)`` removes them again.
        """
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"pad_to_multiple needs a positive int, got {k!r}")
        n = len(self)
        n_pad = -n % k
        if n_pad == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty batch: there are no rows to repeat")
        padding = self[np.arange(n - n_pad, n) % n]
        return Batch.concat([self, padding]), n_pad

    def unpad(self, n_pad: int) -> Batch:
        """Drops the last `n_pad` rows (the inverse of ``pad_to_multiple``)."""
        if n_pad < 0 or n_pad > len(self):
            raise ValueError(f"cannot remove {n_pad} padding rows from a batch of {len(self)} rows")
        return self if n_pad == 0 else self[: len(self) - n_pad]

    # ----------------------------------------------------------------- copies and devices
    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        """A Batch whose tensors live on `device` (non-tensors and meta are shared)."""
        tensors = {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()}
        return Batch._from_parts(tensors, dict(self.non_tensors), dict(self.meta), len(self))

    def clone(self) -> Batch:
        """A deep copy: cloned tensors, deep-copied non-tensors and meta."""
        return Batch._from_parts(
            {k: t.clone() for k, t in self.tensors.items()},
            copy.deepcopy(self.non_tensors),
            copy.deepcopy(self.meta),
            len(self),
        )

    def __eq__(self, other: object) -> bool:
        """Structural equality: same keys, equal values (dtype and shape included), equal meta."""
        if not isinstance(other, Batch):
            return NotImplemented
        return (
            len(self) == len(other)
            and self.tensors.keys() == other.tensors.keys()
            and self.non_tensors.keys() == other.non_tensors.keys()
            and all(_values_equal(self[k], other[k]) for k in self.keys())
            and _values_equal(self.meta, other.meta)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = [
            f"{k}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device}"
            for k, t in self.tensors.items()
        ]
        fields += [f"{k}: object" for k in self.non_tensors]
        meta = f", meta keys={list(self.meta)}" if self.meta else ""
        return f"Batch(len={len(self)}, {{{', '.join(fields)}}}{meta})"

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The batch as plain data a checkpoint keeps (`torch.load(weights_only=True)` reads it back when its
        non-tensors and meta are plain data): tensors, non-tensors as lists, meta."""
        return {"tensors": dict(self.tensors), "non_tensors": {k: v.tolist() for k, v in self.non_tensors.items()},
                "meta": dict(self.meta)}

    @classmethod
    def from_state_dict(cls, state: dict) -> Batch:
        """Inverse of `state_dict`."""
        return cls(state["tensors"], state["non_tensors"], state["meta"])

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict:
        """Tensors travel as raw bytes (see `_tensor_state`) and come back as tensors."""
        return {
            "tensors": {k: _tensor_state(t) for k, t in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
            "len": self._len,
        }

    def __setstate__(self, state: dict) -> None:
        self.tensors = {k: _tensor_from_state(v) for k, v in state["tensors"].items()}
        self.non_tensors = state["non_tensors"]
        self.meta, self._len = state["meta"], state["len"]
