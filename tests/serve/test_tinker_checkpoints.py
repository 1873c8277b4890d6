"""Checkpoints through the real SDK: listed (`RestClient.list_checkpoints` / `list_user_checkpoints`, weights
info), and exported by `save_weights_external` as Hugging Face directories that load in transformers / peft:
a LoRA client's adapter directory, or (the server's `merged_exports`) its merged model, and a full-parameter
client's whole model, each computing the trained client's log-probs."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")

from tests.serve.conftest import TOKENS, logprobs, sft_steps, start_server  # noqa: E402


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits.float()
    return torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def _trained(client, rank: int):
    trainer = client.create_lora_training_client(base_model="tiny", rank=rank, seed=0).result()
    sft_steps(trainer, TOKENS, 2, lr=5e-2 if rank else 1e-3)
    return trainer


def test_checkpoints_are_listed_with_their_weights_info(server):
    trainer = server.client.create_lora_training_client(base_model="tiny", rank=4).result()
    state = trainer.save_state("listed").result().path
    sampler_path = trainer.save_weights_for_sampler("listed-sampler").result().path
    rest = server.rest()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed[state].checkpoint_type == "training" and listed[state].size_bytes > 0
    assert listed[sampler_path].checkpoint_type == "sampler"
    assert state in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
    with pytest.raises(tinker.NotFoundError, match="is not saved here"):
        rest.get_weights_info_by_tinker_path(state.replace("listed", "never-saved")).result()


def test_a_lora_export_is_an_adapter_directory_peft_loads(server, tiny_qwen2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trained(server.client, rank=4)
    path = trainer.save_weights_external("adapter").result().path
    folder = server.checkpoint_dir / trainer.model_id / "external_weights" / "adapter"
    assert path == f"tinker://{trainer.model_id}/external_weights/adapter"
    assert (folder / "adapter_config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen2), folder)
    torch.testing.assert_close(_hf_logprobs(model, TOKENS), logprobs(trainer, TOKENS), atol=1e-5, rtol=0)
    listed = server.rest().list_checkpoints(trainer.model_id).result().checkpoints
    assert [c.checkpoint_type for c in listed if c.tinker_path == path] == ["external"]
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        trainer.save_weights_external("adapter").result()  # an export is never overwritten


def test_a_full_parameter_export_is_a_whole_model(server):
    from transformers import AutoModelForCausalLM

    trainer = _trained(server.client, rank=0)
    trainer.save_weights_external("whole").result()
    folder = server.checkpoint_dir / trainer.model_id / "external_weights" / "whole"
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(_hf_logprobs(model, TOKENS), logprobs(trainer, TOKENS), atol=1e-5, rtol=0)


def test_merged_exports_write_the_merged_model(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    merging, stop = start_server(tiny_qwen2, tmp_path, merged_exports=True)
    try:
        trainer = _trained(merging.client, rank=4)
        trainer.save_weights_external("merged").result()
        folder = tmp_path / trainer.model_id / "external_weights" / "merged"
        assert not (folder / "adapter_config.json").exists()
        model = AutoModelForCausalLM.from_pretrained(folder)
        torch.testing.assert_close(_hf_logprobs(model, TOKENS), logprobs(trainer, TOKENS), atol=1e-5, rtol=0)
    finally:
        stop()


def test_the_serve_command_passes_merged_exports_to_the_server(tiny_qwen2, monkeypatch):
    from hybridflow.cli import main
    from hybridflow.serve import http_api

    started = []
    monkeypatch.setattr(http_api, "serve", lambda config, *args: started.append(config))
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--merged-exports", "--device", "cpu"]) == 0
    assert started[0].merged_exports is True and started[0].models == {"tiny": tiny_qwen2}
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--device", "cpu"]) == 0
    assert started[1].merged_exports is False
