"""The fingerprint of a base model's weights, which a LoRA checkpoint records: its adapters hold only the
change to those weights, so resuming or merging them onto other weights under the same `model.path` would
silently give another model.

    fp = base_fingerprint("models/qwen")       # {"files": 2, "bytes": 988097824, "xxh3": "..."} or None
    problem = base_changed("actor", recorded, "models/qwen", fp)   # a message, or None when it matches

The fingerprint covers the weight files (`*.safetensors`, their index, `pytorch_model*.bin` and its index):
their names, sizes and the xxh3 of their bytes (the checkpoint manifest's checksum), read in full. A path
that is not a local directory is looked up in the Hugging Face cache; a model found nowhere has no
fingerprint (None), and nothing is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

from hybridflow.checkpoint.manifest import file_checksum


def _weight_files(root: Path) -> list[Path]:
    def is_weights(name: str) -> bool:
        return name.endswith((".safetensors", ".safetensors.index.json")) or \
            name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))

    return sorted(p for p in root.iterdir() if p.is_file() and is_weights(p.name))


def _local_dir(model_path: str) -> Path | None:
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub id, or not in the cache: nothing to fingerprint
        return None


def base_fingerprint(model_path: str) -> dict[str, Any] | None:
    """The fingerprint of the weights at `model_path` (see the module docstring); None when there are none."""
    root = _local_dir(model_path)
    files = _weight_files(root) if root is not None else []
    if not files:
        return None
    digest = xxhash.xxh3_128()
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        digest.update(f"{path.name}\0{size}\0{file_checksum(path)}\n".encode())
    return {"files": len(files), "bytes": total, "xxh3": digest.hexdigest()}


def base_changed(role: str, recorded: dict[str, Any] | None, model_path: str,
                 current: dict[str, Any] | None) -> str | None:
    """Why the LoRA `role`'s base weights at `model_path` (`current`) are not the ones a checkpoint recorded
    (`recorded`: {"path": ..., "fingerprint": ...}); None when they match or either is unknown."""
    if not recorded or not recorded.get("fingerprint") or current is None:
        return None
    before = recorded["fingerprint"]
    if before == current:
        return None
    return (f"the base model of the LoRA role {role!r} changed: the checkpoint's adapters were trained on "
            f"{recorded.get('path')} ({before['files']} weight files, {before['bytes']:,} bytes, xxh3 "
            f"{before['xxh3']}); {model_path} now holds {current['files']} files, {current['bytes']:,} bytes, xxh3 "
            f"{current['xxh3']}. The adapters only fit the weights they were trained on")
