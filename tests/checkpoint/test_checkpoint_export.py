"""Export a checkpoint to a Hugging Face directory: from_pretrained loads it with the trainer's logits."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.checkpoint import (
    CheckpointError,
    CheckpointManager,
    export_hf,
    main_export,
    save_hf_assets,
    save_worker_state,
)


@pytest.fixture
def checkpoint(tmp_path, tiny_qwen2, trained):
    model, optimizer, scheduler = trained
    manager = CheckpointManager(tmp_path / "run", keep=2)
    tmp = manager.begin(1)
    save_worker_state(tmp / "actor", model, optimizer, {"lr": scheduler})
    save_hf_assets(tmp / "actor", tiny_qwen2)
    return manager.commit(1, tmp), model


def test_export_gives_same_logits(tmp_path, checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, model = checkpoint
    out = export_hf(path, tmp_path / "hf")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(4, 260, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert loaded.generation_config.eos_token_id == [3]
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


def test_cli_export_bf16_from_run_dir(tmp_path, checkpoint, capsys):
    path, _ = checkpoint
    assert main_export([str(tmp_path / "run"), str(tmp_path / "hf16"), "--dtype", "bfloat16"]) == 0
    assert "exported actor" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert main_export([str(path), str(tmp_path / "nope"), "--role", "critic"]) == 1
    assert "no model for role 'critic'; roles: ['actor']" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="neither a complete checkpoint"):
        export_hf(tmp_path / "empty", tmp_path / "x")


def test_export_untied_llama(tmp_path, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    source = tiny_model_factory("llama", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    manager = CheckpointManager(tmp_path)
    tmp = manager.begin(4)
    save_worker_state(tmp / "actor", model)
    save_hf_assets(tmp / "actor", source)
    with pytest.raises(CheckpointError, match="not a temp dir made by begin"):
        manager.commit(4, tmp_path / "elsewhere")
    loaded = AutoModelForCausalLM.from_pretrained(export_hf(manager.commit(4, tmp), tmp_path / "hf"))
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    ids = torch.randint(4, 260, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_export_refuses_a_target_inside_the_checkpoints(tmp_path, checkpoint):
    from hybridflow.checkpoint import verify

    path, _ = checkpoint
    for target in (path / "hf", path / "actor" / "hf2", path.parent / "exported", path.parent):
        with pytest.raises(CheckpointError, match=f"the export target {target} is inside .* which holds checkpoints: "
                                                  f"choose a directory outside it"):
            export_hf(path, target)
    verify(path)  # untouched


def test_a_full_disk_during_export_leaves_no_directory(tmp_path, checkpoint, monkeypatch, capsys):
    from transformers import PreTrainedModel

    path, _ = checkpoint

    def fills_the_disk(self, folder, *args, **kwargs):
        (tmp_path / "seen").write_text(str(folder))
        (folder / "model.safetensors").write_bytes(b"0" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fills_the_disk)
    assert main_export([str(path), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'hf'}: the disk is full (" in err and "nothing was left there" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "seen"]  # no hf/, no partial directory
    assert (tmp_path / "seen").read_text().startswith(str(tmp_path / ".hf.partial-"))
