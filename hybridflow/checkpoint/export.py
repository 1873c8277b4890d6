"""Checkpoint → Hugging Face model directory (`hybridflow export <checkpoint_dir> <out_dir>`).

At save time `save_hf_assets` stores, inside a role's checkpoint dir, what a Hugging Face directory
needs besides weights: `hf/config.json`, `hf/generation_config.json`, the tokenizer files and
`hf/source.json` (the model path the run started from). `export_hf` then needs only the checkpoint:
it reads the DCP model shards into full CPU tensors in one process (any saved world size), puts them
into a meta-initialised `AutoModelForCausalLM` of the saved config and writes config, generation
config, tokenizer and safetensors with `save_pretrained`, so `AutoModelForCausalLM.from_pretrained`
loads the trained weights and gives the trainer's logits. A reward model's (`hybridflow rm`) saved config
is a sequence classifier's (`head_config`), and it is written as one, which `reward.reward_model.path` loads.

A LoRA checkpoint (its role dir holds peft's `adapter_config.json` and the adapters alone) is written as a
peft adapter directory (`adapter_config.json` naming the base model, `adapter_model.safetensors`, the
tokenizer), which `peft.PeftModel.from_pretrained(base_model, out_dir)` loads; or, with `merge`, as the
base model (read from the path the run started from, or `--model`) with the adapters merged in. A run with a
4-bit base (`model.quantization=nf4`, recorded in `hf/source.json`) trained its adapters on the base's NF4
rounding: the merge adds them to that dequantized base (`quantized_base.to_nf4`), the policy the run sampled from,
written in the base's dtype; its adapter directory loads over the unquantized base (the difference is the 4-bit
rounding).

    hybridflow export outputs/run1/checkpoints/step_00000200 exported/run1
    hybridflow export outputs/run1 exported/run1          # the newest complete checkpoint of a run
    hybridflow export outputs/lora_run exported/merged --merge   # a LoRA run's policy as a whole model
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from hybridflow.checkpoint.fingerprint import base_changed, base_fingerprint
from hybridflow.checkpoint.manager import CheckpointError, disk_full, find_checkpoint, human_bytes
from hybridflow.checkpoint.manifest import MANIFEST
from hybridflow.checkpoint.state import read_full_model_state, read_meta
from hybridflow.utils.lm_class import is_vision_config

HF_DIR, SOURCE_FILE, ADAPTER_CONFIG = "hf", "source.json", "adapter_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def head_config(model_path: str | Path, head: str = "lm", trust_remote_code: bool = False):
    """The Hugging Face config of the model a role trains from `model_path`: its own for a causal LM (`lm`); for
    a reward model (`score`, `hybridflow.engine.train.model`) the `...ForSequenceClassification` of it with one
    label and a pad id (the tokenizer's, else its eos), which reads the score at the last non-pad token."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if head == "score":
        config.num_labels = 1
        config.architectures = [a.replace("ForCausalLM", "ForSequenceClassification")
                                for a in config.architectures or []]
        if config.pad_token_id is None:
            tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
                else tokenizer.eos_token_id
    return config


def _auto_class(config, images: bool):
    """The `transformers` auto class of a saved config: a sequence classifier (a reward model) or a causal LM (of a
    run with or without `images`: `lm_class.lm_auto_class`)."""
    from transformers import AutoModelForSequenceClassification

    from hybridflow.utils.lm_class import lm_auto_class

    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        return AutoModelForSequenceClassification
    return lm_auto_class(config, images)


def save_hf_assets(role_dir: str | Path, model_path: str | Path, head: str = "lm", quantization: str = "none",
                   images: bool = False) -> Path:
    """Store config (`head_config`), generation config and tokenizer of `model_path` under `<role_dir>/hf/`, and
    the base's storage (`model.quantization`) and whether the run's prompts carried `images` (a Qwen3.5 checkpoint
    then trained with its tower: `lm_class.TEXT_FIRST_FAMILIES`) beside its path."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    dest = Path(role_dir) / HF_DIR
    dest.mkdir(parents=True, exist_ok=True)
    head_config(model_path, head).save_pretrained(dest)
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(dest)
    except OSError:
        pass  # the model has no generation_config.json; transformers derives one from the config
    AutoTokenizer.from_pretrained(model_path).save_pretrained(dest)
    config = AutoConfig.from_pretrained(model_path)
    if is_vision_config(config, images):  # a vision-language model's images need its processor
        from transformers import AutoImageProcessor

        AutoImageProcessor.from_pretrained(model_path).save_pretrained(dest)
    (dest / SOURCE_FILE).write_text(json.dumps({"model_path": str(model_path), "quantization": quantization,
                                                "images": images}))
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
              role: str | None = None, dtype: str | torch.dtype | None = None, merge: bool = False) -> Path:
    """Write a Hugging Face model directory for `role` of a checkpoint; return `out_dir`.

    `checkpoint_dir`: a checkpoint (`step_<N>`), or a run's output dir / `checkpoints/` dir (its newest
    complete checkpoint is used). `role`: None takes `exported_role` (the trained policy). `model_path_or_config`:
    None uses the config and tokenizer stored in the checkpoint; a model path takes them from there (and,
    for a LoRA checkpoint, the base weights); a `PretrainedConfig` gives the config only (no tokenizer is
    written). `dtype`: None keeps the saved dtype (a merged LoRA model: the base model's), else "float32" /
    "bfloat16" / "float16". `merge`: a LoRA checkpoint is written as the merged model, not as an adapter
    directory (a full-parameter checkpoint is a whole model either way).
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel

    checkpoint = find_checkpoint(checkpoint_dir)
    out_dir = Path(out_dir).expanduser().resolve()
    _check_target(out_dir, checkpoint)
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
    image_processor = None  # a vision-language model's, written beside its tokenizer
    recorded = _source(role_dir)
    images = bool(recorded.get("images", False))
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
        if is_vision_config(config, images):
            from transformers import AutoImageProcessor

            image_processor = AutoImageProcessor.from_pretrained(source)
    state = read_full_model_state(role_dir, dtype)
    if (role_dir / ADAPTER_CONFIG).is_file():
        base_path = _base_path(role_dir, model_path_or_config, merge)
        _check_base(checkpoint, role, base_path, isinstance(model_path_or_config, (str, Path)), merge)
        model = _lora_model(role_dir, state, config, base_path, dtype, merge, recorded.get("quantization", "none"),
                            images)
    else:
        model = _full_model(role, state, config, dtype, images)
    if generation is not None and isinstance(model, PreTrainedModel):  # not a peft adapter directory
        model.generation_config = generation

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if image_processor is not None:
            image_processor.save_pretrained(folder)

    _write_whole(out_dir, write)
    return out_dir


def _check_target(out_dir: Path, checkpoint: Path) -> None:
    """Refuse an export into a checkpoint, or into the directory of checkpoints it belongs to (their manifests
    and the keep-last-k pruning own what is there)."""
    for folder in (out_dir, *out_dir.parents):
        if (folder / MANIFEST).is_file() or folder == checkpoint.parent:
            raise CheckpointError(f"the export target {out_dir} is inside {folder}, which holds checkpoints: "
                                  f"choose a directory outside it")


def _write_whole(out_dir: Path, write: Callable[[Path], None]) -> None:
    """`write(folder)` into a temporary directory beside `out_dir`, then its files moved into `out_dir` (made
    if needed): a write that fails (a full disk) leaves nothing behind, and `out_dir` as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        write(tmp)
        out_dir.mkdir(exist_ok=True)
        for path in sorted(tmp.iterdir()):
            path.replace(out_dir / path.name)
    except BaseException as exc:
        free = shutil.disk_usage(out_dir.parent).free
        if disk_full(exc, free):
            raise CheckpointError(f"cannot write {out_dir}: the disk is full ({human_bytes(free)} free when the "
                                  f"write failed: {exc}); nothing was left there") from exc
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _full_model(role: str, state: dict[str, torch.Tensor], config, dtype: torch.dtype | None, images: bool):
    """Every weight of the checkpoint in a meta-initialised model of `config` (a causal LM of a run with or without
    `images`, or a reward model's sequence classifier)."""
    saved_dtype = dtype or next(v.dtype for v in state.values() if v.is_floating_point())
    with torch.device("meta"):
        model = _auto_class(config, images).from_config(config, dtype=saved_dtype)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint weights of {role!r} do not match a {type(model).__name__}: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, assign=True)
    return model


def _base_path(role_dir: Path, model_path_or_config, merge: bool) -> str | None:
    """Where a LoRA checkpoint's base model lives: the given model path, else the one its run started from
    (`hf/source.json`); a merge refuses one that is not there."""
    path: str | None
    if isinstance(model_path_or_config, (str, Path)):
        path = str(model_path_or_config)
    else:
        path = _source(role_dir).get("model_path")
    if merge and (path is None or not Path(path).exists()):
        raise CheckpointError(f"merging the LoRA adapters of {role_dir} needs the base model's weights; the run "
                              f"started from {path!r}, which is not there: pass its path (--model)")
    return path


def _source(role_dir: Path) -> dict:
    """What `save_hf_assets` recorded of the run (`hf/source.json`: its model path, the base's storage, whether its
    prompts carried images); {} where the checkpoint has none, a key missing where the checkpoint predates it."""
    source = role_dir / HF_DIR / SOURCE_FILE
    return json.loads(source.read_text()) if source.is_file() else {}


def _check_base(checkpoint: Path, role: str, base_path: str | None, given: bool, merge: bool) -> None:
    """A LoRA checkpoint's base weights against the fingerprint it recorded: a merge onto changed weights found
    where the run started is refused; onto a base `given` (--model), or for an adapter directory, it warns."""
    recorded = read_meta(checkpoint).get("lora_bases", {}).get(role)
    if base_path is None or not recorded:
        return
    problem = base_changed(role, recorded, base_path, base_fingerprint(base_path))
    if problem is None:
        return
    if merge and not given:
        raise CheckpointError(f"{problem}: merging them would write another model than the one trained; pass the "
                              f"base they were trained on (--model)")
    print(f"hybridflow export: warning: {problem}; " + (
        "merging them onto the --model given, as asked" if merge else
        f"the adapter directory names {base_path} as its base: load it on the weights it was trained on"),
        file=sys.stderr)


def _lora_model(role_dir: Path, state: dict[str, torch.Tensor], config, base_path: str | None,
                dtype: torch.dtype | None, merge: bool, quantization: str = "none", images: bool = False):
    """The adapters in `config`'s model (of a run with or without `images`) wrapped by peft, on the meta device
    (its `save_pretrained` writes an adapter directory); with `merge`, in the base model loaded from `base_path`
    (its adapted weights rounded as a 4-bit base's were, with `quantization=nf4`), merged into it."""
    from peft import LoraConfig, get_peft_model
    from hybridflow.utils.lm_class import lm_auto_class

    lora = LoraConfig.from_pretrained(str(role_dir))
    auto = lm_auto_class(config, images)
    if merge:
        assert base_path is not None  # _base_path refuses a merge without one
        base = auto.from_pretrained(base_path, dtype=dtype or "auto")
    else:
        with torch.device("meta"):
            base = auto.from_config(config)
    model = get_peft_model(base, lora)
    model.peft_config["default"].base_model_name_or_path = base_path  # what `PeftModel.from_pretrained` loads
    # the wrapped model, with the names the training engine saved (peft 0.22 types it Tensor | Module)
    inner = cast(torch.nn.Module, model.base_model.model)
    expected = {name for name, p in inner.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"the LoRA adapters of {role_dir} do not match its adapter_config.json on a "
                              f"{type(base).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    inner.load_state_dict(state, strict=False, assign=not merge)
    if merge and quantization == "nf4":
        from peft.tuners.lora import LoraLayer

        from hybridflow.engine.train.quantized_base import dense, to_nf4

        with torch.no_grad():
            for name, layer in inner.named_modules():
                if isinstance(layer, LoraLayer):
                    weight = cast(torch.Tensor, layer.get_base_layer().weight)
                    weight.copy_(dense(to_nf4(weight.detach(), f"{name}.weight")))
    return model.merge_and_unload() if merge else model


def main_export(argv: list[str] | None = None) -> int:
    """`hybridflow export <checkpoint_dir> <out_dir> [--role R] [--dtype D] [--model PATH] [--merge]`."""
    parser = argparse.ArgumentParser(prog="hybridflow export",
                                     description="Write a Hugging Face model directory from a checkpoint.")
    parser.add_argument("checkpoint_dir", help="a step_<N> checkpoint, or a run's output dir (newest one)")
    parser.add_argument("out_dir", help="where the Hugging Face model directory is written")
    parser.add_argument("--role", help="which model of the checkpoint (default: the trained policy, the role "
                                       "whose Hugging Face files it holds: actor for RL runs, sft for SFT runs)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as saved)")
    parser.add_argument("--model", help="take config and tokenizer (and a LoRA checkpoint's base weights) from "
                                        "this path, not the checkpoint")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: write the base model with the adapters merged in, not a peft "
                             "adapter directory (a full-parameter checkpoint is a whole model either way)")
    args = parser.parse_args(argv)
    try:
        checkpoint = find_checkpoint(args.checkpoint_dir)
        role = args.role or exported_role(checkpoint)
        out = export_hf(checkpoint, args.out_dir, args.model, role=role, dtype=args.dtype, merge=args.merge)
    except CheckpointError as exc:
        print(f"hybridflow export: error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {role} of {checkpoint} to {out}")
    return 0
