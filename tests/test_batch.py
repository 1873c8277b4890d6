"""Tests for hybridflow.batch.Batch: every row/key operation, errors and pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hybridflow.batch import Batch


def make(n: int = 7) -> Batch:
    return Batch(
        tensors={
            "ids": torch.arange(n * 3).reshape(n, 3),
            "score": torch.arange(n, dtype=torch.float32) / 10,
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)], "info": [{"row": i, "tags": [i, i]} for i in range(n)]},
        meta={"temperature": 0.7},
    )


def rows_of(b: Batch) -> list[int]:
    return [int(x) for x in b["ids"][:, 0] // 3]


def test_construction_and_access():
    b = make()
    assert len(b) == 7
    assert "ids" in b and "uid" in b and "nope" not in b
    assert b.keys() == ["ids", "score", "uid", "info"]
    assert b["uid"].dtype == object and b["uid"].shape == (7,)
    assert b["info"][2] == {"row": 2, "tags": [2, 2]}
    assert b.meta == {"temperature": 0.7}
    assert len(Batch()) == 0


def test_nested_lists_stay_one_object_per_row():
    b = Batch(non_tensors={"msgs": [[{"role": "user"}], [{"role": "user"}]], "pair": [[1, 2], [3, 4]]})
    assert b["pair"].shape == (2,) and b["pair"][1] == [3, 4]
    assert b["msgs"][0] == [{"role": "user"}]


def test_length_mismatch_names_key_and_lengths():
    with pytest.raises(ValueError, match=r"'b' has 3 rows but the batch has 2 rows"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    b = make()
    with pytest.raises(ValueError, match=r"'x' has 5 rows but the batch has 7 rows"):
        b["x"] = ["a"] * 5
    with pytest.raises(TypeError, match="one entry per row"):
        b["s"] = "a string is not a per-row sequence"
    with pytest.raises(ValueError, match="0-dimensional"):
        b["t"] = torch.tensor(1.0)


def test_setitem_replaces_and_moves_between_kinds():
    b = make()
    b["uid"] = torch.arange(7)
    assert "uid" in b.tensors and "uid" not in b.non_tensors
    b["new"] = np.array([1, 2, 3, 4, 5, 6, 7])
    assert b["new"].dtype == object and b["new"][6] == 7
    single = Batch({"a": torch.zeros(2)})
    single["a"] = torch.zeros(4)  # replacing the only key may change the length
    assert len(single) == 4


def test_getitem_missing_key():
    with pytest.raises(KeyError, match="no key 'zzz'.*available"):
        make()["zzz"]


@pytest.mark.parametrize(
    "index, expected",
    [
        (2, [2]),
        (-1, [6]),
        (slice(1, 6, 2), [1, 3, 5]),
        ([4, 0, 4], [4, 0, 4]),
        (np.array([5, -7]), [5, 0]),
        (torch.tensor([3, 1]), [3, 1]),
        (torch.tensor(4), [4]),
        (torch.tensor([True, False, False, True, False, False, True]), [0, 3, 6]),
        (np.array([False] * 7), []),
        ([], []),
    ],
)
def test_row_indexing(index, expected):
    b = make()
    sub = b[index]
    assert isinstance(sub, Batch) and len(sub) == len(expected)
    assert rows_of(sub) == expected
    assert list(sub["uid"]) == [f"u{i}" for i in expected]
    assert [d["row"] for d in sub["info"]] == expected
    assert sub.meta == b.meta


def test_row_index_errors():
    b = make()
    with pytest.raises(IndexError, match="row 7 is out of range for a batch of 7 rows"):
        b[7]
    with pytest.raises(IndexError, match="mask has length 3"):
        b[torch.tensor([True, False, True])]
    with pytest.raises(TypeError, match="integers or booleans"):
        b[np.array([0.5])]


def test_select_and_pop():
    b = make()
    s = b.select("ids", "uid")
    assert s.keys() == ["ids", "uid"] and len(s) == 7 and s.meta == b.meta
    with pytest.raises(KeyError, match=r"\['bad'\] not in batch"):
        b.select("ids", "bad")
    popped = b.pop("score", "info")
    assert popped.keys() == ["score", "info"]
    assert b.keys() == ["ids", "uid"]
    assert torch.equal(popped["score"], make()["score"])


@pytest.mark.parametrize("k, sizes", [(2, [4, 3]), (3, [3, 2, 2]), (7, [1] * 7), (1, [7])])
def test_uneven_chunk_and_concat_roundtrip(k, sizes):
    b = make()
    parts = b.chunk(k)
    assert [len(p) for p in parts] == sizes
    assert rows_of(parts[-1])[-1] == 6
    assert Batch.concat(parts) == b


def test_chunk_more_than_rows():
    b = make(2)
    with pytest.raises(ValueError, match="cannot chunk 2 rows into 3 non-empty pieces"):
        b.chunk(3)
    parts = b.chunk(3, allow_empty=True)
    assert [len(p) for p in parts] == [1, 1, 0]
    assert Batch.concat(parts) == b
    with pytest.raises(ValueError, match="positive int"):
        b.chunk(0)


def test_split():
    b = make()
    parts = b.split([0, 5, 2])
    assert [rows_of(p) for p in parts] == [[], [0, 1, 2, 3, 4], [5, 6]]
    with pytest.raises(ValueError, match="sum to 7"):
        b.split([3, 3])


def test_concat_errors_and_meta():
    a, c = make(2), make(3)
    c.meta["temperature"] = 1.0
    joined = Batch.concat([a, c])
    assert len(joined) == 5 and joined.meta == {"temperature": 0.7}
    c.pop("uid")
    with pytest.raises(KeyError, match="key 'uid' is missing from batch 1"):
        Batch.concat([a, c])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_repeat_interleave_order():
    b = make(3)
    r = b.repeat_interleave(2)
    assert rows_of(r) == [0, 0, 1, 1, 2, 2]
    assert list(r["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert [d["row"] for d in r["info"]] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="positive int"):
        b.repeat_interleave(0)


def test_union():
    b = make()
    extra = Batch({"adv": torch.ones(7)}, {"uid": b["uid"].copy()}, {"step": 3})
    u = b.union(extra)
    assert set(u.keys()) == {"ids", "score", "uid", "info", "adv"}
    assert u.meta == {"temperature": 0.7, "step": 3}
    assert "adv" not in b
    with pytest.raises(ValueError, match="key 'score' is present in both"):
        b.union(Batch({"score": torch.zeros(7)}))
    with pytest.raises(ValueError, match="equal lengths, got 7 and 2"):
        b.union(make(2))


def test_pad_and_unpad():
    b = make()
    padded, n_pad = b.pad_to_multiple(4)
    assert n_pad == 1 and len(padded) == 8
    assert rows_of(padded) == [0, 1, 2, 3, 4, 5, 6, 6]
    assert padded.unpad(n_pad) == b
    same, zero = b.pad_to_multiple(7)
    assert zero == 0 and same == b
    small, n_pad = make(2).pad_to_multiple(5)
    assert n_pad == 3 and rows_of(small) == [0, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="cannot remove 9 padding rows"):
        b.unpad(9)


def test_to_and_clone_are_independent():
    b = make()
    moved = b.to("cpu")
    assert moved["ids"].device.type == "cpu" and moved == b
    c = b.clone()
    c["ids"][0, 0] = 100
    c["info"][0]["row"] = 100
    assert int(b["ids"][0, 0]) == 0 and b["info"][0]["row"] == 0


def test_equality_checks_values_and_dtypes():
    b = make()
    other = make()
    other["score"] = other["score"].double()
    assert b != other
    assert b != make(6)
    assert b == make()


def test_repr_shows_keys_shapes_dtypes():
    text = repr(make())
    assert "len=7" in text and "ids: [7, 3] int64 cpu" in text and "score: [7] float32" in text
    assert "uid: object" in text and "temperature" in text


def test_pickle_roundtrip_and_slices_are_compact():
    big = Batch({"input_ids": torch.randint(0, 100, (256, 2048))}, {"uid": [str(i) for i in range(256)]})
    data = pickle.dumps(big)
    assert pickle.loads(data) == big
    half = pickle.dumps(big[:16])
    assert len(half) < len(data) / 8  # a slice does not carry its parent's storage
    restored = pickle.loads(half)
    assert restored == big[:16] and isinstance(restored["input_ids"], torch.Tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float16, torch.int32, torch.float64])
def test_pickle_keeps_dtype_shape_grad_and_writability(dtype):
    t = (torch.arange(24).reshape(2, 3, 4) % 3).to(dtype)
    b = Batch({"t": t, "col": t[:, 1], "w": torch.ones(2, 2, requires_grad=True)})
    restored = pickle.loads(pickle.dumps(b))
    assert restored == b
    assert restored["col"].shape == (2, 4) and restored["w"].requires_grad
    restored["t"][0, 0, 0] = 1  # received tensors are ordinary writable tensors
    assert b["t"][0, 0, 0] == 0


def test_pickle_takes_one_row_column_slices():
    # a [1] slice of a [1, 2] tensor counts as contiguous while its stride is 2
    column = torch.tensor([[1.5, 2.5]])[:, 0]
    restored = pickle.loads(pickle.dumps(Batch({"c": column})))
    assert restored["c"].tolist() == [1.5]


def test_torch_multiprocessing_pickler_roundtrip():
    import io

    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reductions)

    b = make()
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(b)
    assert pickle.loads(buf.getvalue()) == b
