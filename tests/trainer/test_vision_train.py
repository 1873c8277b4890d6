"""GRPO on a tiny random Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5 and SmolVLM with geo3k-format data
(`recipes/geo3k_vl.yaml`): prompts as chat messages with `<image>`, an `images` column of PNG bytes drawn with PIL,
`reward_model.ground_truth`; bad image rows are refused before training with the row named; another vision family is
refused by name."""

from __future__ import annotations

import io
import json
import math
import re
import shutil

import pandas as pd
import pytest
import yaml
from PIL import Image, ImageDraw

from hybridflow.config.loader import load_config
from hybridflow.config.validate import ConfigError, validate
from hybridflow.data.files import DataError
from hybridflow.trainer.rl import train
from rl_helpers import read_metrics, reward_file

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 230), "yellow": (230, 220, 30)}


def png(color, size=(56, 84)) -> bytes:
    image = Image.new("RGB", size, COLORS[color])
    ImageDraw.Draw(image).ellipse((8, 8, 40, 40), outline=(0, 0, 0))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def geo3k_rows(colors):
    return [{"data_source": "hiyouga/geometry3k",
             "prompt": [{"role": "user", "content": "<image>Which color fills the picture? Answer in \\boxed{}."}],
             "images": [{"bytes": png(c)}], "ability": "math", "reward_model": {"style": "rule", "ground_truth": c},
             "extra_info": {"index": i}} for i, c in enumerate(colors)]


def write(rows, path):
    pd.DataFrame(rows).to_parquet(path)
    return path


def overrides(model, train_file, out, *extra):
    return [f"model.path={model}", f"data.train_files={train_file}", "data.train_batch_size=2",
            "data.max_prompt_length=128", "data.max_response_length=6", "rollout.n=2", "actor.lr=1e-3",
            "actor.mini_batch_size=null", "trainer.total_steps=2", "trainer.val_every=0",
            "trainer.val_before_train=false", "trainer.save_every=0", "reward.num_workers=1",
            f"trainer.output_dir={out}", *extra]


def test_grpo_trains_two_steps_on_geo3k_format_images(tiny_vlm, tmp_path):
    train_file = write(geo3k_rows(["red", "green", "blue", "yellow"]), tmp_path / "train.parquet")
    out = tmp_path / "run"
    if "qwen3_5" not in str(tiny_vlm):  # a Qwen3.5 checkpoint without images trains as a text model
        cfg = load_config(overrides(tiny_vlm, train_file, out, "data.image_key=null",
                                    f"reward.function={reward_file(tmp_path)}"), "recipes/geo3k_vl.yaml")
        with pytest.raises(ConfigError, match="data.image_key=null: model.path=.* is a vision-language model"):
            train(cfg)
    with pytest.raises(ConfigError, match="a critic for the vision-language model "
                                          "(qwen(2_5|3)_vl|gemma3|qwen3_5|smolvlm) is not supported"):
        train(load_config(overrides(tiny_vlm, train_file, out, "algorithm.adv_estimator=gae"), "recipes/geo3k_vl.yaml"))
    with pytest.raises(ConfigError, match=r"agent.tools: multi-turn episodes of the vision-language model .* are not"):
        train(load_config(overrides(tiny_vlm, train_file, out, "agent.tools=[calculator]"), "recipes/geo3k_vl.yaml"))
    with pytest.raises(ConfigError, match=r"rollout.exact=True: a vision-language model's rollout .* has no such"):
        train(load_config(overrides(tiny_vlm, train_file, out, "rollout.exact=true"), "recipes/geo3k_vl.yaml"))
    cfg = load_config(overrides(tiny_vlm, train_file, out, f"reward.function={reward_file(tmp_path)}"),
                      "recipes/geo3k_vl.yaml")
    train(cfg)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0
        assert row["response_length/mean"] > 0
    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert resolved["rollout"]["engine"] == "vision" and resolved["data"]["image_key"] == "images"


def test_image_key_follows_for_a_vision_model(tiny_vlm, tmp_path):
    from hybridflow.config.follow import followed_lines

    cfg = load_config(overrides(tiny_vlm, tmp_path / "train.parquet", tmp_path / "run"), "recipes/grpo.yaml")
    if "qwen3_5" in str(tiny_vlm):  # a published Qwen3.5 checkpoint trains as a text model unless given images
        assert cfg.data.image_key is None
        return
    assert cfg.data.image_key == "images"
    family = r"\((qwen(2_5|3)_vl|gemma3|smolvlm)\)"
    assert any(re.match(rf"data.image_key=images: model.path is a vision-language model {family}", line)
               for line in followed_lines(cfg))


def test_a_vision_family_without_a_path_is_refused_by_name(tiny_vlm, tmp_path):
    other = tmp_path / "llava"
    shutil.copytree(tiny_vlm, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(ConfigError, match=r"vision-language model_type 'llava' is not supported .* supported: "
                                          r"qwen2_5_vl, qwen3_vl, gemma3, qwen3_5, smolvlm, idefics3"):
        train(load_config(overrides(other, tmp_path / "train.parquet", tmp_path / "run"), "recipes/geo3k_vl.yaml"))


@pytest.mark.parametrize("case,match", [
    ("undecodable", r"row 1, image 0: the image does not decode"),
    ("count", r"row 1: the prompt has 2 '<image>' placeholder\(s\) for 1 image\(s\)"),
    ("too_big", r"row 1, image 0: 2000x2000 = 4000000 pixels, over the image processor's limit"),
])
def test_bad_image_rows_are_refused_before_training(case, match, tiny_vlm, tmp_path):
    if case == "too_big" and ("gemma3" in str(tiny_vlm) or "smolvlm" in str(tiny_vlm)):
        pytest.skip("Gemma 3's and SmolVLM's image processors resize every image to fit the tower: no pixel limit")
    rows = geo3k_rows(["red", "green"])
    if case == "undecodable":
        rows[1]["images"] = [{"bytes": b"not an image"}]
    elif case == "count":
        rows[1]["prompt"] = [{"role": "user", "content": "<image> and <image>?"}]
    else:
        buf = io.BytesIO()
        Image.new("RGB", (2000, 2000)).save(buf, "PNG")
        rows[1]["images"] = [{"bytes": buf.getvalue()}]
    train_file = write(rows, tmp_path / "train.parquet")
    with pytest.raises(DataError, match=match):
        train(load_config(overrides(tiny_vlm, train_file, tmp_path / "run"), "recipes/geo3k_vl.yaml"))


LORA = ("actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=5e-2")


@pytest.mark.parametrize("freeze", [True, False])
def test_lora_grpo_on_a_vlm_exports_an_adapter_and_a_merged_model(freeze, tiny_vlm, tmp_path):
    """LoRA on the language model, the vision tower frozen (`model.freeze_vision`, the default) or given adapters
    too; the checkpoint exports as a peft adapter and a merged model, both of which load in transformers / peft and
    compute the trained policy's log-probs."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from hybridflow.checkpoint import main_export
    from hybridflow.data.image_prompts import VisionPrompts

    train_file = write(geo3k_rows(["red", "green", "blue", "yellow"]), tmp_path / "train.parquet")
    out = tmp_path / "run"
    train(load_config(overrides(tiny_vlm, train_file, out, *LORA, f"model.freeze_vision={str(freeze).lower()}",
                                "trainer.save_every=2", f"reward.function={reward_file(tmp_path)}"),
                      "recipes/geo3k_vl.yaml"))
    assert main_export([str(out), str(tmp_path / "adapter")]) == 0
    assert main_export([str(out), str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file()  # the merged model takes images as before
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    changed = {n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])}
    assert any(t in n for n in changed for t in (".language_model.", ".text_model."))
    assert any(t in n for n in changed for t in (".visual.", ".vision_tower.", ".vision_model.")) is not freeze
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlm), tmp_path / "adapter")
    prompts = VisionPrompts.from_pretrained(str(tmp_path / "merged"), AutoTokenizer.from_pretrained(tmp_path / "merged"))
    ids, vision = prompts.encode("<image> which color?", [{"bytes": png("blue")}], "test row")
    inputs = dict(input_ids=torch.tensor([ids]), **prompts.family.model_inputs(torch.tensor([ids]), vision))
    with torch.no_grad():
        logp = [m(**inputs).logits.log_softmax(-1) for m in (peft_model, merged, base)]
    # the tiny random Qwen3.5's chunked delta rule magnifies rounding: peft's own in-memory merge differs from the
    # adapters by 2.5e-4, as much as scaling every weight by 1 + 1e-7 moves it (the export equals that merge exactly)
    atol = 1e-3 if "qwen3_5" in str(tiny_vlm) else 1e-4
    torch.testing.assert_close(logp[0], logp[1], atol=atol, rtol=0)
    assert (logp[1] - logp[2]).abs().max() > 10 * atol  # the exported policy is the trained one, not the base


def test_rounds_with_different_image_sizes_concatenate_with_their_images():
    """Dynamic sampling's rounds come from different prompt batches: their images (padded per batch to its largest)
    concatenate, each row keeping its own pixels."""
    import torch

    from hybridflow.batch import Batch
    from hybridflow.data.image_prompts import VisionInputs
    from hybridflow.trainer.step_math import concat_rounds

    small = VisionInputs(torch.randn(4, 6), torch.tensor([[1, 2, 2]]))
    large = VisionInputs(torch.randn(12, 6), torch.tensor([[1, 2, 2], [1, 2, 4]]))

    def round_of(vision, prompt):
        prompts = torch.tensor([prompt])
        return Batch({"prompts": prompts, "attention_mask": torch.ones_like(prompts), **VisionInputs.pad_rows([vision])},
                     {"uid": [str(prompt)]})

    merged = concat_rounds([round_of(small, [5, 6]), round_of(large, [7, 8, 9])], pad_id=0)
    rows = VisionInputs.unpad_rows(merged["pixel_values"], merged["image_grid_thw"])
    for got, want in zip(rows, (small, large)):
        assert got is not None and torch.equal(got.pixel_values, want.pixel_values)
        assert torch.equal(got.image_grid_thw, want.image_grid_thw)


def test_a_qwen3_5_checkpoint_is_a_vision_language_model_only_in_a_run_with_images(tiny_model_factory):
    """A published Qwen3.5 checkpoint trains its language model alone in a run without images (docs/models.md), and
    as the vision-language model it is with them; images for a text model are refused by name."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from hybridflow.data.image_prompts import VisionPrompts
    from hybridflow.utils.lm_class import lm_auto_class, vision_model_type

    path = tiny_model_factory("qwen3_5")
    config = AutoConfig.from_pretrained(path)
    assert lm_auto_class(config) is AutoModelForCausalLM and vision_model_type(str(path)) is None
    assert lm_auto_class(config, images=True) is AutoModelForImageTextToText
    assert vision_model_type(str(path), images=True) == "qwen3_5"
    text = tiny_model_factory("qwen2")
    with pytest.raises(ValueError, match=r"model_type 'qwen2' is not a vision-language model \(no vision_config\); "
                                         r"data.image_key needs one of qwen2_5_vl, qwen3_vl, gemma3, qwen3_5"):
        VisionPrompts.from_pretrained(str(text), AutoTokenizer.from_pretrained(text))


def endpoint_runner(tmp_path) -> str:
    agent = tmp_path / "agent.py"
    agent.write_text("async def play(client, row):\n    return 0.0\n")
    return f"agent.runner={agent}:play"


@pytest.mark.parametrize("tiny_vlm", ["qwen2_5_vl"], indirect=True)
def test_agent_images_follows_the_model_in_an_endpoint_run(tiny_vlm, tiny_model_factory, tmp_path, capsys):
    """One rule (`role_needs.carries_images`) decides whether a run's prompts can carry images: `data.image_key`, or
    an endpoint way in with `agent.images` true. Unset, `agent.images` follows the model: true for a vision-language
    model (Qwen2.5-VL here), false for a Qwen3.5 checkpoint as published (its language model trains alone, as text),
    null for a text model; `hybridflow config` says what it became and why. `agent.images=true` makes the Qwen3.5
    checkpoint the vision-language model it is (`RunFacts.vision`), as `data.image_key` does without an endpoint."""
    from hybridflow.cli import main as cli_main
    from hybridflow.config.resolved import resolve_facts
    from hybridflow.config.role_needs import carries_images

    published, text = tiny_model_factory("qwen3_5"), tiny_model_factory("qwen2")
    runner = endpoint_runner(tmp_path)
    for model, extra, images, vision in ((published, [], None, False),
                                         (published, ["data.image_key=images"], None, True),
                                         (published, [runner], False, False),
                                         (published, [runner, "agent.images=true"], True, True),
                                         (tiny_vlm, [runner], True, True),
                                         (text, [runner], None, False)):
        cfg = load_config(overrides(model, tmp_path / "train.parquet", tmp_path / "run", *extra),
                          "recipes/grpo.yaml")
        assert cfg.agent.images is images, (model, extra)
        assert carries_images(cfg) is vision and resolve_facts(cfg).vision is vision, (model, extra)
    for model, line in ((published, "#   agent.images=false: model.path is a qwen3_5 checkpoint as published: "
                                     "through agent.runner its language model trains alone, as text, on the fast "
                                     "engine (agent.images=true: the vision-language model"),
                        (tiny_vlm, "#   agent.images=true: model.path is a vision-language model (qwen2_5_vl): the "
                                   "requests of agent.runner may carry images")):
        assert cli_main(["config", "--no-checks", f"model.path={model}", runner]) == 0
        assert any(printed.startswith(line) for printed in capsys.readouterr().out.splitlines()), line


@pytest.mark.parametrize("tiny_vlm", ["qwen2_5_vl"], indirect=True)
def test_agent_images_against_the_model_or_without_an_endpoint_is_refused_by_name(tiny_vlm, tiny_model_factory,
                                                                                   tmp_path):
    """Before any model loads: `agent.images=true` for a model without a vision tower (a text model, or a Qwen3.5
    checkpoint's language model saved alone), `agent.images=false` for a vision-language model that trains only as
    one, `agent.images` set without an endpoint way in; and a Qwen3.5 run that `agent.images=true` made a vision run
    the vision path cannot serve says that unset, its language model trains alone."""
    from transformers import AutoModelForCausalLM

    published, text = tiny_model_factory("qwen3_5"), tiny_model_factory("qwen2")
    alone = tmp_path / "alone"
    AutoModelForCausalLM.from_pretrained(published).save_pretrained(alone)  # model_type qwen3_5_text, no tower
    runner = endpoint_runner(tmp_path)
    no_way = (r"agent.images={}: it says whether an endpoint's requests may carry images, and no endpoint way in is "
              r"set \(agent.runner, agent.verifiers, agent.gym, agent.openenv\)")
    for model, extra, match in (
            (text, [runner, "agent.images=true"], r"agent.images=true: model.path=\S+ \(model_type 'qwen2'\) has no "
                                                  r"vision tower \(no vision_config in its config.json\)"),
            (alone, [runner, "agent.images=true"], r"model.path=\S+ \(model_type 'qwen3_5_text'\) has no vision"),
            (tiny_vlm, [runner, "agent.images=false"], r"agent.images=false: model.path=\S+ is a vision-language "
                                                       r"model \(qwen2_5_vl\), which trains only as one.*unset, it "
                                                       r"follows true"),
            (published, ["agent.images=true"], no_way.format("true")),
            (published, ["agent.images=false"], no_way.format("false")),
            (published, [runner, "agent.images=true", "trainer.n_workers=2"],
             r"(?s)trainer.n_workers=2 with agent.runner and a vision-language model.*agent.images=true: the qwen3_5 "
             r"checkpoint at model.path=\S+ is the vision-language model; with agent.images unset \(or false\), "
             r"agent.runner trains its language model alone, as text, on the fast engine")):
        cfg = load_config(overrides(model, tmp_path / "train.parquet", tmp_path / "run", *extra), "recipes/grpo.yaml")
        with pytest.raises(ConfigError, match=match):
            validate(cfg)
