"""`hybridflow train` through the OpenAI-compatible endpoint on CPU, one test per way in: agent code
(`agent.runner`), a verifiers environment group (single-turn, multi-turn and tool environments, each with a
rubric), a textarena game (`agent.gym`) and an OpenEnv server (`agent.openenv`); a Gymnasium `Env` with text
spaces is played through the same adapter. The batch the trainer sees and the `agent/...` metrics are checked."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from hybridflow.agents.endpoint.endpoint_rollout import EndpointRollout
from hybridflow.agents.episodes import runner_of
from hybridflow.config.loader import load_config
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.trainer.rl import train
from rl_helpers import read_metrics
from test_multiturn_train import capture_batches, write_rows

RUNNER = """
    async def play(client, row, word="again"):
        messages = [{"role": "user", "content": row["raw_prompt"][-1]["content"]}]
        for turn in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            text = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"{word} {turn}"}]
        return {"reward": len(text) % 3, "metrics": {"chars": len(text)}}
"""

VERIFIERS_ENV = '''
    import verifiers as vf
    from datasets import Dataset


    def digit_share(completion, **kwargs) -> float:
        """The share of digits in the last model message (a reward a random model sometimes earns)."""
        texts = [m["content"] if isinstance(m, dict) else m.content for m in completion
                 if (m["role"] if isinstance(m, dict) else m.role) == "assistant"]
        text = str(texts[-1] or "") if texts else ""
        return sum(c.isdigit() for c in text) / max(len(text), 1)


    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b


    class Retry(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Check it and answer again."}]


    def load_environment(examples: int = 1):
        data = Dataset.from_list([{"question": f"What is {i} + 3?", "answer": str(i + 3)} for i in range(examples)])
        single = vf.SingleTurnEnv(dataset=data, system_prompt="Answer with a number.",
                                  rubric=vf.Rubric(funcs=[digit_share]))
        multi = Retry(dataset=data, max_turns=2, rubric=vf.Rubric(funcs=[digit_share]))
        tools = vf.ToolEnv(dataset=data, tools=[add], max_turns=2, rubric=vf.Rubric(funcs=[digit_share]))
        return vf.EnvGroup(envs=[single, multi, tools], env_names=["single", "multi", "tools"])
'''

OPENENV_SERVER = '''
    from openenv.core.env_server import Action, Environment, Observation, State, create_app


    class Say(Action):
        message: str


    class Heard(Observation):
        prompt: str


    class Numbers(Environment):
        """Asks for a number twice; each answer earns its share of digits."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.turn = 0

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.turn = 0
            return Heard(prompt=f"Say a number (game {seed}).", done=False, reward=0.0)

        def step(self, action, timeout_s=None, **kwargs):
            self.turn += 1
            share = sum(c.isdigit() for c in action.message) / max(len(action.message), 1)
            return Heard(prompt="Another one.", done=self.turn >= 2, reward=share)

        @property
        def state(self):
            return State(step_count=self.turn)


    app = create_app(Numbers, Say, Heard, env_name="numbers", max_concurrent_envs=16)
'''

GYM_ENV = """
    import gymnasium as gym


    class Count(gym.Env):
        observation_space = gym.spaces.Text(64)
        action_space = gym.spaces.Text(64)

        def __init__(self, target=3):
            self.target, self.turn = target, 0

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.turn = 0
            return f"Count to {self.target} (game {seed}).", {}

        def step(self, action):
            self.turn += 1
            return "Go on.", float(len(action) % 2), self.turn >= self.target, False, {}
"""


def overrides(model, data, out, *extra):
    return [f"model.path={model}", f"data.train_files={data}", "data.train_batch_size=2", "rollout.n=2",
            "data.max_prompt_length=192", "data.max_response_length=64", "agent.max_tokens_per_turn=6",
            "actor.lr=1e-4", "actor.mini_batch_size=null", "trainer.total_steps=2", "trainer.val_before_train=false",
            "reward.num_workers=1", f"trainer.output_dir={out}", *extra]  # reward.function follows: environment


def write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


def test_agent_code_trains_through_the_endpoint(tiny_qwen2, tmp_path, monkeypatch):
    runner = write(tmp_path / "agent.py", RUNNER)
    data = write_rows(tmp_path / "train.jsonl", 2)
    seen = capture_batches(monkeypatch)
    train(load_config(overrides(tiny_qwen2, data, tmp_path / "out", f"agent.runner={runner}:play",
                                "agent.env_kwargs={word: More}", "agent.max_concurrent_requests=1",
                                "agent.runner_processes=2", "trainer.total_steps=1"), "recipes/grpo.yaml"))
    (metrics,) = read_metrics(tmp_path / "out")
    assert metrics["agent/turns/mean"] == 2 and metrics["agent/segments/mean"] == 1
    assert metrics["agent/runner_errors"] == 0
    assert metrics["agent/dropped"] == 0 and metrics["agent/kv_reused_tokens"] > 0
    assert 0 <= metrics["agent/metric/chars/mean"] <= 6
    (batch,) = seen
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    prompt = tokenizer.decode(batch["prompts"][0][batch["attention_mask"][0, :batch["prompts"].shape[1]].bool()])
    assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": "What is 0 + 0?"}], tokenize=False,
                                                   add_generation_prompt=True)  # the runner's first request
    special = set(tokenizer.all_special_ids)
    odd = 0  # trajectories whose model wrote a special token inside a turn: the text the client got lacks it
    for r in range(len(batch)):
        mask, ids = batch["response_mask"][r].tolist(), batch["responses"][r].tolist()
        inside = [i for i in range(len(mask) - 1) if mask[i] == 1 and mask[i + 1] == 1]
        odd += any(ids[i] in special for i in inside)
    assert metrics["agent/token_mismatch"] == odd  # every other trajectory is exactly the template's rendering
    for r in range(len(batch)):
        assert batch["score"][r] == batch["extra_info"][r]["env_reward"]
        user_turns = [m["content"] for m in batch["extra_info"][r]["messages"] if m["role"] == "user"]
        assert user_turns[1:] == ["More 0"]  # env_kwargs reached the runner; the final conversation is recorded
        model_runs = batch["response_mask"][r].diff().eq(1).sum() + batch["response_mask"][r][0]
        assert model_runs == 2


def test_a_verifiers_environment_group_trains_two_steps(tool_calling_model, tmp_path, monkeypatch):
    from hybridflow.agents.adapters.verifiers_runner import export_dataset

    env = write(tmp_path / "vf_env.py", VERIFIERS_ENV)
    assert export_dataset(str(env), str(tmp_path / "train.parquet")) == 3
    seen = capture_batches(monkeypatch)
    train(load_config(overrides(tool_calling_model, tmp_path / "train.parquet", tmp_path / "out",
                                f"agent.verifiers={env}", "agent.env_kwargs={examples: 1}", "data.train_batch_size=3",
                                "data.max_prompt_length=256", "agent.max_tokens_per_turn=40",
                                "data.max_response_length=128", "rollout.temperature=0.3"), "recipes/grpo.yaml"))
    # at temperature 1 the model sometimes garbles its call (the fixture's docstring), and which sample does
    # depends on how the concurrent requests were batched: a loaded machine missed every tool call of a step
    metrics = read_metrics(tmp_path / "out")
    assert len(metrics) == 2 and all(m["agent/dropped"] == 0 for m in metrics)
    assert all(0 <= m["agent/metric/digit_share/mean"] <= 1 for m in metrics)  # the rubric's own metric
    for batch in seen:
        turns = {batch["extra_info"][r]["info"]["env_id"]: batch["agent/turns"][r] for r in range(len(batch))}
        assert turns["single"] == 1 and turns["multi"] == 2 and 1 <= turns["tools"] <= 2
        for r in range(len(batch)):
            assert batch["score"][r] == pytest.approx(batch["extra_info"][r]["runner_metrics"]["digit_share"])
        tool_rows = [r for r in range(len(batch)) if batch["extra_info"][r]["info"]["env_id"] == "tools"]
        roles = [[m["role"] for m in batch["extra_info"][r]["messages"]] for r in tool_rows]
        assert any("tool" in r for r in roles)  # the model's tool calls went to the environment's tools


def test_a_textarena_game_trains_two_steps(tiny_model_factory, tmp_path):
    pytest.importorskip("textarena")
    model = tiny_model_factory("qwen2", max_positions=1024)  # the game's rules take ~600 byte-level tokens
    data = write_rows(tmp_path / "train.jsonl", 2)
    train(load_config(overrides(model, data, tmp_path / "out", "agent.gym=textarena:GuessTheNumber-v0",
                                "agent.max_turns=2", "data.max_prompt_length=768"), "recipes/grpo.yaml"))
    metrics = read_metrics(tmp_path / "out")
    assert len(metrics) == 2
    assert all(m["agent/dropped"] == 0 and m["agent/turns/max"] <= 2 and m["agent/metric/turns/mean"] >= 1
               for m in metrics)


@pytest.fixture
def openenv_server(tmp_path):
    pytest.importorskip("openenv.core")
    write(tmp_path / "numbers_env.py", OPENENV_SERVER)
    log = tmp_path / "uvicorn.log"
    # --port 0: uvicorn binds a free port and logs it (a port probed free here could be taken by another
    # test worker first); a file, not a pipe, so that nothing blocks on an unread log
    with log.open("w") as sink:
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "numbers_env:app", "--host", "127.0.0.1",
                                   "--port", "0"], cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"running on http://127\.0\.0\.1:(\d+)", log.read_text())):
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail(f"the OpenEnv server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        port = int(found.group(1))
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def test_an_openenv_server_trains_two_steps_through_its_client(tiny_qwen2, tmp_path, openenv_server):
    data = write_rows(tmp_path / "train.jsonl", 2)
    kwargs = json.dumps({"base_url": openenv_server, "observation_field": "prompt"})
    train(load_config(overrides(tiny_qwen2, data, tmp_path / "out", "agent.openenv=openenv.core:GenericEnvClient",
                                f"agent.env_kwargs={kwargs}"), "recipes/grpo.yaml"))
    metrics = read_metrics(tmp_path / "out")
    assert len(metrics) == 2
    assert all(m["agent/dropped"] == 0 and m["agent/turns/mean"] == 2 and m["agent/segments/mean"] == 1
               for m in metrics)
    assert all(0 <= m["agent/env_reward/mean"] <= 2 for m in metrics)


def test_a_gymnasium_env_with_text_spaces_is_played_turn_by_turn(tiny_qwen2, tmp_path):
    from hybridflow.config.schema import AgentConfig

    env = write(tmp_path / "count_env.py", GYM_ENV)
    cfg = AgentConfig(gym=f"{env}:Count", env_kwargs={"target": 2}, max_turns=3, max_tokens_per_turn=5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=4, max_model_len=256)
    rollout = EndpointRollout(cfg, tokenizer, 48, 128, *runner_of(cfg))
    rows = [{"index": 7, "raw_prompt": "Play the game.", "extra_info": {}}]
    (per_row,) = rollout.run(engine, [[1]], rows, SamplingParams(n=2, temperature=1.0, seed=0))
    for trajectory in per_row:
        assert trajectory.dropped is None and trajectory.turns == 2 and trajectory.metrics == {"turns": 2.0}
        assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "user", "assistant"]
        assert trajectory.messages[1]["content"] == "Count to 2 (game 7)."  # reset with the row's index as seed
        answers = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
        assert trajectory.env_reward == sum(len(a) % 2 for a in answers)


IMAGE_RUNNER = """
    import base64
    import io
    import random

    from PIL import Image


    def picture(color, size):
        buf = io.BytesIO()
        Image.new("RGB", size, color).save(buf, "PNG")
        return {"type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


    async def play(client, row):
        shade = 60 * int(row["index"])
        question = [picture((200, shade, 30), (56, 84)), {"type": "text", "text": row["raw_prompt"][-1]["content"]}]
        messages = [{"role": "user", "content": question}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        first = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": first},
                     {"role": "user", "content": [{"type": "text", "text": "And now?"},
                                                  picture((30, shade, 200), (56, 56))]}]
        await client.chat.completions.create(model="policy", messages=messages)
        # a reward no two trajectories share: a group of equal rewards has no advantage, and its step no gradient
        return random.random()
"""

TEXT_PARTS_RUNNER = """
    import random


    async def play(client, row):
        messages = [{"role": "user", "content": [{"type": "text", "text": row["raw_prompt"][-1]["content"]}]}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        first = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And now?"}]
        await client.chat.completions.create(model="policy", messages=messages)
        # a reward no two trajectories share: a group of equal rewards has no advantage, and its step no gradient
        return random.random()
"""

IMAGE_GYM = """
    import numpy as np


    class Shades:
        def reset(self, seed=None):
            self.turn = 0
            return {"text": "Which shade?", "image": np.full((56, 84, 3), 40 * (seed or 0), np.uint8)}, {}

        def step(self, action):
            self.turn += 1
            return np.full((56, 56, 3), 200, np.uint8), float(len(action) % 2), self.turn >= 2, False, {}
"""


def test_a_vision_model_trains_through_the_endpoint_with_images_in_each_episode(tiny_vlm, tmp_path, monkeypatch):
    """GRPO, 2 steps of a tiny VLM whose runner sends an image with its first request and another with its second:
    every training row carries both images (in token order), its ids hold their image tokens (as many as the
    family's processor makes of each: Qwen's merged patches, Gemma 3's fixed count, SmolVLM's tiles), and the steps
    train with finite losses. What the endpoint does not serve for a VLM is refused by name before loading."""
    from PIL import Image

    from hybridflow.config.validate import ConfigError
    from hybridflow.data.image_prompts import VisionInputs, VisionPrompts

    runner = write(tmp_path / "agent.py", IMAGE_RUNNER)
    data = write_rows(tmp_path / "train.jsonl", 2)
    out = tmp_path / "out"
    # SmolVLM's second image (3 x 3 tiles and the whole image) takes 65 of the context turn's tokens
    args = [f"agent.runner={runner}:play", "agent.runner_processes=1", "data.max_response_length=128",
            "agent.max_tokens_per_turn=4"]
    if "qwen3_5" in str(tiny_vlm):  # a Qwen3.5 checkpoint as published: the vision-language model by this key alone
        args.append("agent.images=true")
    for extra, match in ((["data.image_key=images"], r"data.image_key=images with agent.runner: the runner writes"),
                         (["trainer.n_workers=2"], r"trainer.n_workers=2 with agent.runner and a vision-language"),
                         (["agent.tools=[calculator]"], r"agent.tools: multi-turn episodes of the vision-language "
                                                        r"model .* in the in-process agent loop are not supported")):
        with pytest.raises(ConfigError, match=match):
            train(load_config(overrides(tiny_vlm, data, out, *args, *extra), "recipes/grpo.yaml"))
    seen = capture_batches(monkeypatch)
    train(load_config(overrides(tiny_vlm, data, out, *args), "recipes/grpo.yaml"))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        assert m["agent/dropped"] == 0 and m["agent/runner_errors"] == 0 and m["agent/segments/mean"] == 1
        assert m["agent/turns/mean"] == 2
    prompts = VisionPrompts.from_pretrained(str(tiny_vlm), AutoTokenizer.from_pretrained(tiny_vlm))
    image_id = prompts.family.image_token_id
    sent = prompts.image_tokens(prompts.process([Image.new("RGB", (56, 84)), Image.new("RGB", (56, 56))], "sent"))
    for batch in seen:
        assert len(batch) == 4
        rows = VisionInputs.unpad_rows(batch["pixel_values"], batch["image_grid_thw"])
        for r, vision in enumerate(rows):
            grid = vision.image_grid_thw
            first, second = prompts.image_tokens(vision)
            assert [first, second] == sent  # the 56 x 84 picture, then the 56 x 56 one (Gemma 3: the same count)
            assert vision.pixel_values.shape[0] == int(grid[:, :3].prod(-1).sum())
            pixels = vision.pixel_values.split(grid[:, :3].prod(-1).tolist())
            assert not torch.equal(pixels[0].mean(0), pixels[1].mean(0))  # two pictures, not one twice
            real = batch["attention_mask"][r].bool()
            prompt_width = batch["prompts"].shape[1]
            in_prompt = (batch["prompts"][r] == image_id) & real[:prompt_width]
            in_context = (batch["responses"][r] == image_id) & real[prompt_width:] & (batch["response_mask"][r] == 0)
            assert int(in_prompt.sum()) == first and int(in_context.sum()) == second


@pytest.mark.parametrize("tiny_vlm", ["qwen3_5"], indirect=True)
def test_a_qwen3_5_endpoint_run_without_agent_images_trains_as_text_on_the_fast_engine(tiny_vlm, tmp_path):
    """A published Qwen3.5 checkpoint (its vision tower beside the language model) through the endpoint with
    `agent.images` unset: the key follows to false, and the language model trains alone on the fast engine, its
    runner's text parts served as text (the previous test sets `agent.images=true`: the vision path, an image in each
    request)."""
    runner = write(tmp_path / "agent.py", TEXT_PARTS_RUNNER)
    data = write_rows(tmp_path / "train.jsonl", 2)
    out = tmp_path / "out"
    train(load_config(overrides(tiny_vlm, data, out, f"agent.runner={runner}:play", "agent.runner_processes=1",
                                "trainer.total_steps=1"), "recipes/grpo.yaml"))
    (metrics,) = read_metrics(out)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert metrics["agent/turns/mean"] == 2 and metrics["agent/runner_errors"] == 0
    assert metrics["agent/dropped"] == 0
    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert resolved["rollout"]["engine"] == "fast" and resolved["agent"]["images"] is False


def test_a_gym_environment_shows_the_model_images(tiny_vlm, tmp_path):
    """`agent.gym` observations that are images (a `{"text", "image"}` mapping, then a uint8 array) reach a VLM as
    image parts: each trajectory holds both images in order, the reset's 56 x 84 one first."""
    from PIL import Image

    from hybridflow.config.schema import AgentConfig
    from hybridflow.data.image_prompts import VisionPrompts
    from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine

    env = write(tmp_path / "shades_env.py", IMAGE_GYM)
    cfg = AgentConfig(gym=f"{env}:Shades", max_turns=3, max_tokens_per_turn=4, runner_processes=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [tokenizer.eos_token_id], 4, 512)
    prompts = VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer)
    rollout = EndpointRollout(cfg, tokenizer, 128, 200, *runner_of(cfg), images=prompts)  # SmolVLM's 56 x 56: 65
    try:
        (per_row,) = rollout.run(engine, [[1]], [{"index": 2, "raw_prompt": "Look.", "extra_info": {}}],
                                 SamplingParams(n=2, temperature=1.0, seed=0))
    finally:
        rollout.close()
    for trajectory in per_row:
        assert trajectory.dropped is None and trajectory.turns == 2 and trajectory.segments == 1
        shown = [Image.new("RGB", (84, 56), (80,) * 3), Image.new("RGB", (56, 56), (200,) * 3)]  # reset(seed=2), step
        assert trajectory.vision.pixel_values.equal(prompts.process(shown, "shown").pixel_values)
        assert "Which shade?" in trajectory.messages[1]["content"] and len(trajectory.messages[1]["images"]) == 1
