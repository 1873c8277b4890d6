"""`rollout.exact=true` is refused up front where it cannot hold, each problem naming the key and why; a model
outside the dense families (or a shape the kernels do not take) is refused from its Hugging Face config."""

from __future__ import annotations

import json

import pytest

from hybridflow.config import ConfigError, load_config, validate


def _problems(*overrides, check_paths: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(["rollout.exact=true", "rollout.n=2", *overrides]), n_workers=1, check_paths=check_paths)
    return str(e.value)


def test_an_exact_config_passes():
    overrides = ["rollout.exact=true", "rollout.n=2", "actor.lora.rank=8", "actor.mini_batch_size=4"]
    validate(load_config(overrides), n_workers=1, check_paths=False)


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=hf", "transformers.generate runs other kernels than the trainer's"),
    ("rollout.top_p=0.9", "a truncated sample's is not"),
    ("rollout.top_k=50", "use rollout.top_k=-1 rollout.top_p=1.0"),
    ("actor.rollout_correction.mode=token_tis", "actor.rollout_correction.mode=token_tis has nothing to correct"),
    ("model.compile=true", "compiled layers fuse the elementwise ops"),
    ("actor.use_packing=false", "needs actor.use_packing=true and model.attn_implementation=sdpa"),
    ("model.attn_implementation=eager", "got True and 'eager'"),
])
def test_refusals_name_the_key_and_why(override, message):
    assert message in _problems(override)


def test_several_ranks_and_a_separate_rollout_pass():
    for ranks in (["trainer.n_workers=2", "actor.lora.rank=4"], ["rollout.placement=separate"]):
        validate(load_config(["rollout.exact=true", "rollout.n=2", "actor.mini_batch_size=4", *ranks]), n_workers=1,
                 check_paths=False)


def test_lora_dropout_is_refused():
    assert "actor.lora.dropout=0.1: dropout in the update's forward" in _problems("actor.lora.rank=4",
                                                                                 "actor.lora.dropout=0.1")


def test_models_outside_the_kernels_are_refused_from_their_config(tiny_qwen2, tmp_path):
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe", "architectures": []}))
    gelu = tmp_path / "gelu"
    gelu.mkdir()
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu", "num_attention_heads": 8}))
    assert "model_type 'qwen3_moe' has no exact path (dense llama, qwen2, qwen3, mistral only" in \
        _problems(f"model.path={moe}", check_paths=True)
    message = _problems(f"model.path={gelu}", check_paths=True)
    assert "hidden_act 'gelu': the exact MLP is silu-and-mul" in message
    assert "head_dim=8: the exact attention and rotary kernels take a power of two >= 16" in message
    assert "exact" not in _problems(f"model.path={tiny_qwen2}", "data.train_files=[]", check_paths=True)
