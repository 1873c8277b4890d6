"""RewardManager: pool and inline scoring, failures and timeouts turned into fallback scores, async submit;
rows that hang time out together, and a function that fails every row of several batches stops the run."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.rewards import RewardFunctionFailed, RewardManager, rows_from, scores_to_token_scores

USER_REWARD = """
import os
import time

def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "raise":
        raise RuntimeError("boom")
    if solution_str == "sleep":
        time.sleep(60)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "exit":
        raise SystemExit(2)
    if solution_str == "slow":
        time.sleep(0.3)
        return {"score": 1.0, "pid": os.getpid()}
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_reward.py"
    path.write_text(textwrap.dedent(USER_REWARD))
    return f"{path}:score"


def _rows(texts, truth="a"):
    return [("demo", t, truth, {"i": i}) for i, t in enumerate(texts)]


def test_pool_failures_give_fallback_and_the_run_continues(reward_file):
    texts = ["a", "b", "raise", "a", "sleep", "a", "die", "a"]
    with RewardManager(reward_file, num_workers=2, timeout_s=1.0, fallback_score=-1.0) as manager:
        result = manager.score(_rows(texts))
        assert result.scores == [1.0, 0.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0]
        assert result.metrics["reward/errors"] == 3.0
        assert result.metrics["reward/timeouts"] == 1.0
        assert "RuntimeError: boom" in result.errors[2]
        assert result.errors[4].startswith("timeout")
        assert "died" in result.errors[6]
        assert result.extras["length"] == [1, 1, None, 1, None, 1, None, 1]
        assert result.metrics["reward/length/mean"] == 1.0
        assert result.metrics["reward/mean"] == pytest.approx(sum(result.scores) / 8)
        # The hung and dead workers were replaced: the next batch scores normally.
        again = manager.score(_rows(["a"] * 40))
        assert again.scores == [1.0] * 40 and again.metrics["reward/errors"] == 0.0


def test_submit_is_asynchronous(reward_file):
    with RewardManager(reward_file, num_workers=2, timeout_s=5.0) as manager:
        manager.score(_rows(["a"]))  # workers started
        future = manager.submit(_rows(["slow"] * 4))
        assert not future.done()  # returned while the rows are still sleeping in the workers
        result = future.result(timeout=30)
        assert result.scores == [1.0] * 4
        assert len(set(result.extras["pid"])) == 2  # both workers scored


def test_inline_mode_scores_in_the_callers_thread(reward_file):
    manager = RewardManager(reward_file, num_workers=0, fallback_score=0.25)
    future = manager.submit(_rows(["a", "raise", "b", "exit"]))
    assert future.done()
    result = future.result()
    assert result.scores == [1.0, 0.25, 0.0, 0.25] and result.metrics["reward/errors"] == 2.0
    assert result.errors[3] == "error: SystemExit: 2"


def test_builtin_auto_on_a_batch():
    batch = Batch(
        tensors={"response_mask": torch.ones(3, 4)},
        non_tensors={
            "data_source": ["openai/gsm8k", "lighteval/MATH", "openai/gsm8k"],
            "response_text": ["#### 12", "so $\\frac{1}{2}$", "#### 13"],
            "ground_truth": ["12", "0.5", "12"],
            "extra_info": [{}, {}, {}],
        },
    )
    result = RewardManager("auto", num_workers=0).score(batch)
    assert result.scores == [1.0, 1.0, 0.0]


def test_bad_input_raises_at_submit():
    manager = RewardManager("auto", num_workers=0)
    with pytest.raises(ValueError, match="no reward for data_source 'nowhere'"):
        manager.submit([("nowhere", "x", "y", None)])
    with pytest.raises(KeyError, match=r"missing \['ground_truth'\]"):
        rows_from({"data_source": ["a"], "response_text": ["x"]})
    with pytest.raises(ValueError, match="unknown reward function"):
        RewardManager("not_a_reward", num_workers=0)


def test_scores_to_token_scores_puts_score_on_last_real_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = scores_to_token_scores([0.5, -1.0, 2.0, 3.0], mask)
    expected = torch.zeros(4, 4)
    expected[0, 2], expected[1, 0], expected[2, 0], expected[3, 3] = 0.5, -1.0, 2.0, 3.0
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="scores must be"):
        scores_to_token_scores([1.0], mask)


def test_scores_verl_format_gsm8k_rows_from_the_data_layer():
    from hybridflow.data.gsm8k_synthetic import make_rows

    rows = make_rows(6, "train", seed=0)
    solutions = [r["extra_info"]["answer"] for r in rows]  # worked solutions ending in "#### n"
    batch = {
        "data_source": [r["data_source"] for r in rows],
        "response_text": solutions[:3] + ["I am not sure."] * 3,
        "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
        "extra_info": [r["extra_info"] for r in rows],
    }
    result = RewardManager("auto", num_workers=0).score(batch)
    assert result.scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_a_worker_that_died_while_idle_is_replaced(reward_file):
    with RewardManager(reward_file, num_workers=1, timeout_s=5.0) as manager:
        manager.score(_rows(["a"]))
        worker = manager._pool._workers[0].process
        worker.kill()
        worker.join()
        result = manager.score(_rows(["a", "b", "a"]))
        assert result.scores == [1.0, 0.0, 1.0] and result.metrics["reward/errors"] == 0.0
        assert manager._pool.restarts == 1


def test_timeout_blames_the_hung_row_not_its_finished_chunk_mates(reward_file):
    # One worker; the hung row sits mid-chunk after rows it finished but had not reported yet.
    texts = ["a"] * 20 + ["sleep"] + ["b"] * 20
    with RewardManager(reward_file, num_workers=1, timeout_s=1.0) as manager:
        result = manager.score(_rows(texts))
    assert [i for i, e in enumerate(result.errors) if e] == [20]
    assert result.errors[20].startswith("timeout")
    assert result.scores == [1.0] * 20 + [0.0] * 21


def test_rows_that_hang_time_out_together_not_one_after_another(reward_file):
    # One row after another this costs 12 x (2 s + a worker restart); isolated it is about two timeouts.
    with RewardManager(reward_file, num_workers=1, timeout_s=2.0) as manager:
        start = time.monotonic()
        result = manager.score(_rows(["sleep"] * 12))
        first = time.monotonic() - start
        assert result.metrics["reward/timeouts"] == 12.0 and manager._pool.isolated
        start = time.monotonic()
        assert manager.score(_rows(["sleep"] * 12)).metrics["reward/timeouts"] == 12.0
        again = time.monotonic() - start
        assert manager.score(_rows(["a", "raise", "b"])).scores == [1.0, 0.0, 0.0]  # isolated rows still score
        assert not manager._pool.isolated  # a batch without a timeout goes back to chunked scoring
    assert first < 12.0 and again < 6.0, (first, again)


def test_every_row_failing_for_several_batches_stops_with_the_first_error_of_the_last(reward_file):
    with RewardManager(reward_file, num_workers=0, max_failed_batches=2) as manager:
        manager.score(_rows(["raise", "raise"]))
        manager.score(_rows(["raise", "a"]))  # one row scored: the count starts again
        manager.score(_rows(["raise"]))
        manager.score(_rows(["raise"]), counted=False)  # a validation batch neither counts nor resets
        with pytest.raises(RewardFunctionFailed, match=r"failed on every row of 2 training batches in a row "
                                                       r"\(reward.max_failed_steps=2\); the first error of the last "
                                                       r"one: error: SystemExit: 2"):
            manager.score(_rows(["exit", "raise"]))


def test_pool_workers_die_with_a_killed_controller(reward_file, tmp_path):
    """SIGKILL leaves no chance to clean up: the workers' parent-death signal ends them."""
    import json
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "controller.py"
    script.write_text("import json, sys, time\nfrom hybridflow.rewards.scoring_pool import ScoringPool\n"
                      "from hybridflow.rewards.scorer import RewardSpec\n"
                      "if __name__ == '__main__':\n"
                      f"    pool = ScoringPool(RewardSpec.of({reward_file!r}), 2, 5.0)\n"
                      "    pool.run([('row', ('demo', 'a', 'a', {}))] * 4)\n"
                      "    print(json.dumps([w.process.pid for w in pool._workers]), flush=True)\n"
                      "    time.sleep(600)\n")
    controller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = json.loads(controller.stdout.readline())
    controller.kill()
    controller.wait()
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}") and
                 open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"]
    for pid in alive:  # on failure, do not leave them behind
        os.kill(pid, signal.SIGKILL)
    assert alive == []


def test_what_a_reward_function_prints_is_capped_per_row(tmp_path, capfd):
    path = tmp_path / "loud.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    print('x' * 10 ** 6)\n    raise KeyboardInterrupt\n")
    with RewardManager(f"{path}:score", num_workers=1, timeout_s=30.0, fallback_score=-1.0) as manager:
        result = manager.score(_rows(["a", "b"]))
    assert result.scores == [-1.0, -1.0] and "KeyboardInterrupt" in result.errors[0]
    out, _ = capfd.readouterr()
    assert out.count("[hybridflow: this call printed more than 4096 characters; the rest is dropped]") == 2
    assert len(out) < 2 * 4200


def test_a_stop_signal_while_the_pool_starts_ends_the_processes_already_started(reward_file, monkeypatch):
    """A SIGTERM that arrives while the second worker starts is answered as its start ends (`held_signals`): the
    pool's construction fails with `Interrupted`, and both started processes are ended then, not orphaned (their
    pipe closed by the garbage collector, they printed a BrokenPipeError after the run's last line)."""
    import contextlib
    import os
    import signal

    from hybridflow.rewards import scoring_pool
    from hybridflow.rewards.scorer import RewardSpec
    from hybridflow.utils import stop_signals
    from hybridflow.utils.stop_signals import Interrupted, StopAtOnce, held_signals

    started = []

    def recorded(process, *rest):
        started.append(process)
        return worker(process, *rest)

    @contextlib.contextmanager
    def signalled_in_the_second():
        with held_signals():
            yield
            if len(started) == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    worker = scoring_pool._Worker
    monkeypatch.setattr(scoring_pool, "_Worker", recorded)
    monkeypatch.setattr(scoring_pool, "held_signals", signalled_in_the_second)
    monkeypatch.setattr(stop_signals, "_last", None)  # not a copy of another test's signal
    with StopAtOnce(), pytest.raises(Interrupted, match="SIGTERM"):
        scoring_pool.ScoringPool(RewardSpec.of(reward_file), 3, 5.0)
    assert len(started) == 2 and [p.is_alive() for p in started] == [False, False]
