"""What the benchmarks share: a framework child process's environment, the allocator's and the device's peak
memory, the versions a comparison with TRL ran against, the commit a result measured, and writing its JSON.
Import it before hybridflow: it keeps the user's PyTorch allocator setting, which importing hybridflow changes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
# read before hybridflow is imported, which sets it (expandable segments) where it is unset
USER_ALLOC_CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def child_env(framework: str) -> dict[str, str]:
    """The environment of a framework's child process: TRL runs with PyTorch's allocator settings as the
    user left them (an empty value is PyTorch's default, and stops importing hybridflow in the child from
    setting ours), hybridflow with its own."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if framework == "trl":
        env["PYTORCH_CUDA_ALLOC_CONF"] = USER_ALLOC_CONF
    return env


def peak_memory_gb(device: str) -> float:
    """Peak tensor memory: PyTorch's allocator peak on a GPU (memory outside it, such as our KV cache in
    CUDA virtual memory, is in `DeviceMemoryWatch`), the process's peak RSS on a CPU."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)


class DeviceMemoryWatch:
    """Samples the GPU's used memory (`cudaMemGetInfo`: everything on the device, allocator cache, CUDA
    context and memory mapped outside PyTorch included) every `interval` s in a thread until `stop()`."""

    def __init__(self, interval: float = 0.05) -> None:
        import threading

        import torch

        self.peak = 0
        self._stop = threading.Event()

        def poll() -> None:
            while not self._stop.is_set():
                free, total = torch.cuda.mem_get_info()
                self.peak = max(self.peak, total - free)
                self._stop.wait(interval)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        """Stops sampling; returns the peak in GiB."""
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


def trl_versions() -> dict:
    """{"versions": transformers' and TRL's} where both import, else {}: what a comparison with TRL ran against."""
    try:
        import transformers
        import trl
    except ImportError:
        return {}
    return {"versions": {"transformers": transformers.__version__, "trl": trl.__version__}}


def git_commit() -> str | None:
    """The checkout's commit, `-dirty` with local changes (None outside git): what a run measured.
    `HYBRIDFLOW_COMMIT` overrides it (the device machine's copy of `.git` is the session's first: pass the commit
    being measured, `HYBRIDFLOW_COMMIT=<sha> bash bench/h200.sh ...`)."""
    if os.environ.get("HYBRIDFLOW_COMMIT"):
        return os.environ["HYBRIDFLOW_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=HERE,
                             check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def write_json(report: dict, out: str | Path) -> Path:
    """A benchmark's JSON at `out` (its folder made first); says where. Every bench script writes through it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return out
