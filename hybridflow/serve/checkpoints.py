"""What the service keeps on disk under `--checkpoint-dir`: training state, Hugging Face exports, their listing.

- `save_state` (the SDK's `save_weights`): `ROOT/MODEL_ID/NAME.pt`, named `tinker://MODEL_ID/weights/NAME`: the
  base model's name, the rank (0: full-parameter), the trained tensors and Adam's moments; written whole or not
  at all (a temporary file renamed).
- `export` (the SDK's `save_weights_external`): `ROOT/MODEL_ID/external_weights/NAME/`, named
  `tinker://MODEL_ID/external_weights/NAME`: a Hugging Face directory. A LoRA client's is a peft adapter
  directory (`PeftModel.from_pretrained(base, dir)`), or with `merged` its merged model; a full-parameter
  client's is its whole model. The base's tokenizer is written beside the model. Written to a temporary
  directory, then renamed.
- `checkpoints(model_id)` lists both kinds (newest first) as the SDK's `Checkpoint`s, and `weights_info(path)`
  answers what a saved state trains.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tinker import types

from hybridflow.engine.train.quantized_base import dense, is_nf4
from hybridflow.serve.trainee import Trainee

_NAME = re.compile(r"\w[\w.-]*")  # a checkpoint name: one file name, never a path
_PATH = re.compile(r"tinker://(session-[\w-]+:train:\d+)/(weights|external_weights)/(\w[\w.-]*)")
_TYPES: dict[str, types.CheckpointType] = {"weights": "training", "external_weights": "external"}


class CheckpointStore:
    """Training states and exports under one root directory (see the module docstring)."""

    def __init__(self, root: Path, merged_exports: bool) -> None:
        self.root = root
        self.merged_exports = merged_exports

    def _where(self, path: str, kind: str | None = None) -> Path:
        match = _PATH.fullmatch(path)
        if match is None or (kind is not None and match[2] != kind):
            valid = f"tinker://MODEL/{kind or 'weights'}/NAME"
            raise ValueError(f"checkpoint path {path!r} is not one this server returned ({valid})")
        folder = self.root / match[1]
        return folder / f"{match[3]}.pt" if match[2] == "weights" else folder / "external_weights" / match[3]

    def _new(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[str, Path]:
        if not _NAME.fullmatch(name):
            raise ValueError(f"checkpoint name {name!r}: use letters, digits, '-', '_' and '.', not first")
        path = f"tinker://{model_id}/{kind}/{name}"
        target = self._where(path)
        if target.exists() and not overwrite:
            raise ValueError(f"{path} exists ({target}); pick another name" + (" or pass overwrite" if
                                                                             kind == "weights" else ""))
        target.parent.mkdir(parents=True, exist_ok=True)
        return path, target

    def save_state(self, model_id: str, name: str, overwrite: bool, base: str, trainee: Trainee) -> str:
        path, file = self._new(model_id, "weights", name, overwrite)
        tmp = file.with_suffix(".tmp")
        torch.save({"base": base, **trainee.state()}, tmp)
        os.replace(tmp, file)
        return path

    def load_state(self, path: str) -> dict[str, Any]:
        file = self._where(path, "weights")
        if not file.is_file():
            raise ValueError(f"checkpoint {path!r} is not saved here (no {file})")
        return torch.load(file, map_location="cpu", weights_only=True)

    def weights_info(self, path: str) -> types.WeightsInfoResponse:
        state = self.load_state(path)
        rank = state["rank"]
        return types.WeightsInfoResponse(base_model=state["base"], is_lora=rank > 0, lora_rank=rank or None)

    def export(self, model_id: str, name: str, trainee: Trainee, base_model: Any, base_path: Path) -> str:
        """Write the client's weights as a Hugging Face directory (see the module docstring); its tinker path."""
        from transformers import AutoTokenizer

        path, folder = self._new(model_id, "external_weights", name, overwrite=False)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=folder.parent))
        try:
            if trainee.adapters is None:
                trainee.model.save_pretrained(tmp)
            elif self.merged_exports:
                merged = _dense_copy(base_model)
                merged.load_state_dict(dict(trainee.sampler_weights()), strict=False)
                merged.save_pretrained(tmp)
            else:
                _adapter_model(trainee, base_model, base_path).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(base_path).save_pretrained(tmp)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def checkpoints(self, model_id: str | None = None) -> list[types.Checkpoint]:
        """The saved states and exports of `model_id` (None: of every model), newest first."""
        found = []
        for folder in sorted(self.root.glob(model_id or "session-*:train:*")):
            entries = [("weights", f, f.stem) for f in folder.glob("*.pt")]
            entries += [("external_weights", d, d.name) for d in (folder / "external_weights").glob("*")
                        if not d.name.startswith(".")]
            for kind, file, name in entries:
                size = sum(f.stat().st_size for f in file.rglob("*") if f.is_file()) if file.is_dir() else \
                    file.stat().st_size
                found.append(types.Checkpoint(
                    checkpoint_id=f"{kind}/{name}", checkpoint_type=_TYPES[kind], size_bytes=size,
                    time=datetime.fromtimestamp(file.stat().st_mtime, timezone.utc),
                    tinker_path=f"tinker://{folder.name}/{kind}/{name}"))
        return sorted(found, key=lambda c: c.time, reverse=True)


def _adapter_model(trainee: Trainee, base_model: Any, base_path: Path) -> Any:
    """A peft `PeftModel` of the client's adapters (on the meta device's copy of the base: no weights copied),
    whose `save_pretrained` writes the adapter directory."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    assert trainee.adapters is not None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(base_model.config)
    config = copy.deepcopy(trainee.adapters.peft_config)
    config.base_model_name_or_path = str(base_path)  # what `PeftModel.from_pretrained` loads
    model = get_peft_model(skeleton, config)
    model.base_model.model.load_state_dict(trainee.trained(), strict=False, assign=True)
    return model


def _dense_copy(base_model: Any) -> Any:
    """A copy of the base whose 4-bit weights (`hybridflow serve --quantization nf4`) are dequantized: what a merged
    export's adapted weights are loaded into and saved from. The memo hands `deepcopy` each 4-bit weight's dense
    copy in its place (copying an `NF4Tensor` itself would quantize it again, with the default blocks)."""
    dense_weights = {id(p): torch.nn.Parameter(dense(p.data), requires_grad=False)
                     for p in base_model.parameters() if is_nf4(p.data)}
    return copy.deepcopy(base_model, memo=dense_weights)
