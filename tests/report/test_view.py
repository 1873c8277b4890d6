"""`hybridflow view`'s data side: the token-level records a step writes, the incremental reading of a run's
files as they grow, and the JSON routes (aiohttp's server on 127.0.0.1). The page itself, in Chromium:
test_view_page.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.report.live import JsonlTail, RunView, make_app
from hybridflow.report.runlog import ReportError
from hybridflow.tracking.rollout_records import rollout_records


class CharTokenizer:
    """Token id i is the character chr(ord('a') + i)."""

    def batch_decode(self, seqs):
        return ["".join(chr(ord("a") + t) for t in seq) for seq in seqs]


def multiturn_batch():
    """Two rows of a 3-token prompt and a 6-token response: row 0 a model turn, an environment turn, a model
    turn; row 1 three model tokens then padding. Row 0's tokens came from policy versions 4, 4, -, -, 5, 5."""
    responses = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 0, 0, 0]])
    attention = torch.cat([torch.ones(2, 3, dtype=torch.long), torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])], dim=1)
    return Batch({"responses": responses, "attention_mask": attention,
                  "response_mask": torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]]),
                  "rollout_log_probs": torch.tensor([[-0.1, -0.2, 0.0, 0.0, -3.0, -0.5], [-1.0] * 3 + [0.0] * 3]),
                  "old_log_probs": torch.tensor([[-0.1, -0.3, 0.0, 0.0, -2.5, -0.5], [-1.0] * 3 + [0.0] * 3]),
                  "advantages": torch.tensor([[0.5] * 6, [-0.5] * 6]),
                  "rollout_versions": torch.tensor([[4, 4, 5, 5, 5, 5], [5] * 6])},
                 {"uid": ["g0", "g0"], "data_source": ["toy", "toy"], "score": [1.0, 0.0],
                  "raw_prompt": [[{"role": "user", "content": "count"}]] * 2})


def test_rollout_records_keep_turns_values_and_staleness():
    records = rollout_records(multiturn_batch(), CharTokenizer(), rows=5, version=5)
    assert len(records) == 2
    first, second = records
    assert first["tokens"] == list("abcdef") and first["trained"] == [1, 1, 0, 0, 1, 1]
    assert first["logprob"][4] == pytest.approx(-3.0) and first["old_logprob"][4] == pytest.approx(-2.5)
    assert first["advantage"] == [0.5] * 6 and first["staleness"] == [1, 1, 0, 0, 0, 0]
    assert first["prompt"] == "count" and first["score"] == 1.0 and first["version"] == 5
    assert second["tokens"] == list("ghi") and second["trained"] == [1, 1, 1]  # the padding is dropped
    assert rollout_records(multiturn_batch(), CharTokenizer(), rows=0, version=5) == []


def test_records_without_optional_values_leave_them_out():
    batch = multiturn_batch().select("responses", "attention_mask", "response_mask")
    (record,) = rollout_records(batch, CharTokenizer(), rows=1, version=0)
    assert set(record) == {"uid", "data_source", "score", "prompt", "version", "tokens", "trained"}


def test_tail_reads_appended_lines_waits_for_a_torn_one_and_restarts_on_a_new_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not written yet
    path.write_text('{"step": 1, "a": 1}\nnot json\n{"step": 2, "a"')
    assert [row["step"] for _, row in tail.read()] == [1] and tail.unreadable == 1
    with open(path, "a") as f:
        f.write(': 2}\n{"step": 3, "a": 3}\n')
    assert [row["step"] for _, row in tail.read()] == [1, 2, 3]
    path.write_text('{"step": 1, "a": 9}\n')  # a new run in the same directory
    assert [row["a"] for _, row in tail.read()] == [9]


def test_rollout_records_are_read_back_by_offset(tmp_path):
    lines = [{"step": s, "tokens": ["x"] * s, "uid": f"g{s}-{i}"} for s in (1, 2) for i in range(2)]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    view = RunView(tmp_path)
    assert view.rollout_steps() == [1, 2]
    assert [r["uid"] for r in view.rollout_records(2)] == ["g2-0", "g2-1"]
    assert view.rollouts.rows[0][1] == {"step": 1}  # only the index is held in memory


def test_missing_run_dir_is_refused(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        RunView(tmp_path / "nope")


def test_routes_serve_the_files_as_they_grow(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n')
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "prompt": "p", "response": "r", "reward": 1}\n')

    async def scenario():
        async with TestClient(TestServer(make_app(tmp_path))) as client:
            page = await client.get("/")
            assert page.status == 200 and "plotly.min.js" in await page.text()
            assert (await client.get("/static/plotly.min.js")).status == 200
            first = await (await client.get("/api/metrics")).json()
            assert first == {"rows": [{"step": 1, "reward/mean": 0.1}], "next": 1}
            with open(tmp_path / "metrics.jsonl", "a") as f:
                f.write('{"step": 2, "reward/mean": 0.2}\n')
            assert (await (await client.get("/api/metrics?since=1")).json())["rows"] == [
                {"step": 2, "reward/mean": 0.2}]
            assert (await client.get("/api/metrics?since=x")).status == 400
            assert (await (await client.get("/api/rollouts")).json()) == {"steps": []}
            (tmp_path / "rollouts.jsonl").write_text('{"step": 2, "tokens": ["a"], "trained": [1]}\n')
            assert (await (await client.get("/api/rollouts")).json()) == {"steps": [2]}
            step = await (await client.get("/api/rollouts/2")).json()
            assert step["records"][0]["tokens"] == ["a"]
            assert (await client.get("/api/rollouts/two")).status == 400
            samples = await (await client.get("/api/samples")).json()
            assert samples["rows"][0]["response"] == "r"
            run = await (await client.get("/api/run")).json()
            assert run["files"] == ["metrics.jsonl", "rollouts.jsonl", "samples.jsonl"]

    asyncio.run(scenario())


def test_a_port_in_use_is_refused_with_the_way_out(tmp_path):
    import socket

    from hybridflow.report.live import serve

    (tmp_path / "metrics.jsonl").write_text("")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ReportError, match=rf"cannot listen on 127\.0\.0\.1:{port} .*--port 0"):
            serve(tmp_path, "127.0.0.1", port)
