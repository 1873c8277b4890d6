"""Checkpoint → Hugging Face model directory (`hybridflow export <checkpoint_dir> <out_dir>`).

At save time `save_hf_assets` stores, inside a role's checkpoint dir, what a Hugging Face directory
needs besides weights: `hf/config.json`, `hf/generation_config.json`, the tokenizer files and
`hf/source.json` (the model path the run started from). `export_hf` then needs only the checkpoint:
it reads the DCP model shards into full CPU tensors in one process (any saved world size), puts them
into a meta-initialised `AutoModelForCausalLM` of the saved config and writes config, generation
config, tokenizer and safetensors with `save_pretrained`, so `AutoModelForCausalLM.from_pretrained`
loads the trained weights and gives the trainer's logits.

    hybridflow export outputs/run1/checkpoints/step_00000200 exported/run1
    hybridflow export outputs/run1 exported/run1          # the newest complete checkpoint of a run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hybridflow.checkpoint.manager import CheckpointError, find_checkpoint
from hybridflow.checkpoint.state import read_full_model_state

HF_DIR, SOURCE_FILE = "hf", "source.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_hf_assets(role_dir: str | Path, model_path: str | Path) -> Path:
    """Store config, generation config and tokenizer of `model_path` under `<role_dir>/hf/`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    dest = Path(role_dir) / HF_DIR
    dest.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(model_path).save_pretrained(dest)
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(dest)
    except OSError:
        pass  # the model has no generation_config.json; transformers derives one from the config
    AutoTokenizer.from_pretrained(model_path).save_pretrained(dest)
    (dest / SOURCE_FILE).write_text(json.dumps({"model_path": str(model_path)}))
    return dest


def exported_role(checkpoint: Path) -> str:
    """The role of a checkpoint whose model is exported by default: the one its trainer saved Hugging Face
    assets for (`actor` in an RL run, `sft` in an SFT run)."""
    roles = sorted(p.name for p in checkpoint.iterdir() if (p / HF_DIR).is_dir())
    if len(roles) != 1:
        saved = sorted(p.name for p in checkpoint.iterdir() if (p / "model").is_dir())
        raise CheckpointError(f"checkpoint {checkpoint} has Hugging Face assets for {roles or 'no role'}; pick "
                              f"the model to export with role= (--role): one of {saved}")
    return roles[0]


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, model_path_or_config=None,
              role: str | None = None, dtype: str | torch.dtype | None = None) -> Path:
    """Write a Hugging Face model directory for `role` of a checkpoint; return `out_dir`.

    `checkpoint_dir`: a checkpoint (`step_<N>`), or a run's output dir / `checkpoints/` dir (its newest
    complete checkpoint is used). `role`: None takes `exported_role` (the trained policy). `model_path_or_config`:
    None uses the config and tokenizer stored in the checkpoint; a model path takes them from there; a
    `PretrainedConfig` gives the config only (no tokenizer is written). `dtype`: None keeps the saved dtype,
    else "float32" / "bfloat16" / "float16".
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

    checkpoint = find_checkpoint(checkpoint_dir)
    role = role or exported_role(checkpoint)
    role_dir = checkpoint / role
    if not (role_dir / "model").is_dir():
        roles = sorted(p.name for p in checkpoint.iterdir() if (p / "model").is_dir())
        raise CheckpointError(f"checkpoint {checkpoint} has no model for role {role!r}; roles: {roles}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}; valid: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    source = model_path_or_config if model_path_or_config is not None else role_dir / HF_DIR
    if isinstance(source, PretrainedConfig):
        config, tokenizer, generation = source, None, None
    else:
        if not Path(source).exists() and model_path_or_config is None:
            raise CheckpointError(f"{checkpoint} stores no Hugging Face config ({source} missing); pass "
                                  f"the model path it was trained from")
        config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:
            generation = None
    state = read_full_model_state(role_dir, dtype)
    saved_dtype = dtype or next(v.dtype for v in state.values() if v.is_floating_point())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=saved_dtype)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint weights of {role!r} do not match a {type(model).__name__}: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, assign=True)
    if generation is not None:
        model.generation_config = generation
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def main_export(argv: list[str] | None = None) -> int:
    """`hybridflow export <checkpoint_dir> <out_dir> [--role R] [--dtype D] [--model PATH]`."""
    parser = argparse.ArgumentParser(prog="hybridflow export",
                                     description="Write a Hugging Face model directory from a checkpoint.")
    parser.add_argument("checkpoint_dir", help="a step_<N> checkpoint, or a run's output dir (newest one)")
    parser.add_argument("out_dir", help="where the Hugging Face model directory is written")
    parser.add_argument("--role", help="which model of the checkpoint (default: the trained policy, the role "
                                       "whose Hugging Face files it holds: actor for RL runs, sft for SFT runs)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as saved)")
    parser.add_argument("--model", help="take config and tokenizer from this path, not the checkpoint")
    args = parser.parse_args(argv)
    try:
        role = args.role or exported_role(find_checkpoint(args.checkpoint_dir))
        out = export_hf(args.checkpoint_dir, args.out_dir, args.model, role=role, dtype=args.dtype)
    except CheckpointError as exc:
        print(f"hybridflow export: error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {role} to {out}")
    return 0
