#!/usr/bin/env bash
# Fetch the wheels that bring FlashInfer's decode attention (the `flashinfer_graph` contender of
# benchmarks/kernels.py) to the GPU machine, which has no network: FlashInfer's JIT package and
# apache-tvm-ffi, for the machine's CPython 3.12 on x86-64. Everything else `import flashinfer` needs
# (numpy, ninja, nvidia-ml-py, einops, tabulate, click, requests, tqdm, packaging) is in its image, and
# its nvcc compiles the decode kernels at first use (FLASHINFER_CUDA_ARCH_LIST=9.0 in h200_run.sh).
# Usage, here: bash benchmarks/peer_wheels.sh; then `run` with carry [".whl"]: h200_run.sh installs them.
# `bash benchmarks/peer_wheels.sh build` instead fetches into .whl/build/ what `mirage-serve build-cache` needs there
# beyond the image (egglog and what its import pulls in, tqdm, platformdirs); carry [".whl/build"] (about 52 MB,
# too much to carry with FlashInfer's): build_cache_gpu.sh installs them.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
dest=.whl
[ "${1:-}" = build ] && dest=.whl/build
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
}
if [ "$dest" = .whl/build ]; then
  mkdir -p .whl/build
  pip_dl "egglog>=13.2,<14" black click cloudpickle graphviz mypy-extensions opentelemetry-api importlib-metadata zipp \
    packaging pathspec platformdirs pytokens typing-extensions tqdm filelock
  ls -la .whl/build
  exit 0
fi
pip_dl flashinfer-python==0.6.18.post1
pip_dl "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0"
ls -la .whl
