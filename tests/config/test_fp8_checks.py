"""`rollout.quantization=fp8` is refused up front where it cannot run (the CPU, the transformers fallback, exact mode,
a mixture of experts, shapes the FP8 GEMMs do not take), each problem naming the keys (`hybridflow train` on the
CPU: `tests/trainer/test_fp8_start.py`); left unset, `actor.rollout_correction.mode` follows to `token_tis`."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main as cli_main
from hybridflow.config import ConfigError, load_config, validate


def _problems(*overrides, check_paths: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(["rollout.quantization=fp8", "rollout.n=2", *overrides]), n_workers=1,
                 check_paths=check_paths)
    return str(e.value)


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=hf", "rollout.quantization=fp8 with rollout.engine=hf: transformers.generate has no FP8 path"),
    ("rollout.exact=true", "rollout.quantization=fp8 with rollout.exact=true: exact mode samples with the trainer's"),
    ("trainer.device=cpu", "rollout.quantization=fp8 with trainer.device=cpu (the run is on the CPU): FP8 rollout "
                           "runs on CUDA GPUs of sm_89 or newer; use rollout.quantization=none"),
])
def test_refusals_name_the_keys_and_why(override, message):
    assert message in _problems(override)


def test_models_outside_the_fp8_path_are_refused_from_their_config(tiny_qwen2, tmp_path):
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    changes = {"moe": {"model_type": "qwen3_moe", "architectures": []}, "odd": {"intermediate_size": 100}}
    for name, change in changes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
    assert "model_type 'qwen3_moe' is a mixture of experts: its experts' grouped GEMMs have no FP8 path" in \
        _problems(f"model.path={tmp_path / 'moe'}", check_paths=True)
    assert "{'intermediate_size': 100}: FP8 GEMMs take dimensions that are multiples of 16" in \
        _problems(f"model.path={tmp_path / 'odd'}", check_paths=True)


def test_the_correction_follows_to_token_tis_unless_set(capsys):
    assert cli_main(["config", "--no-checks", "rollout.quantization=fp8"]) == 0  # a partial config: no model
    assert "#   actor.rollout_correction.mode=token_tis: rollout.quantization=fp8 samples with FP8 weights" in \
        capsys.readouterr().out
    assert load_config(["rollout.quantization=fp8"]).actor.rollout_correction.mode == "token_tis"
    for mode in ("none", "token_mis"):  # a mode the user set is kept
        cfg = load_config(["rollout.quantization=fp8", f"actor.rollout_correction.mode={mode}"])
        assert cfg.actor.rollout_correction.mode == mode
    assert load_config([]).actor.rollout_correction.mode == "none"
