#!/usr/bin/env bash
# Builds the entries shipped in kernel_cache/entries/: every bundled model config, one after the
# other, into one cache directory (so each model's searches are seeded from the entries of the
# models before it, and models with the same kernels share them), then copies the entries there.
# Each entry is verified at its own shapes as in any build; nothing is copied from a failed build.
#
# Usage: bash benchmarks/build_shipped_cache.sh [CACHE_DIR] [MODEL_ID ...]
#   CACHE_DIR: where to build (default: a new temporary directory); resumable when given again.
# Writes the per-model reports (JSON) and wall times to benchmarks/results/<date>-cpu-shipped-cache/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${1:-$(mktemp -d /tmp/mirage-shipped-cache.XXXXXX)}"
shift || true
MODELS=("$@")
if [ ${#MODELS[@]} -eq 0 ]; then
    MODELS=(meta-llama/Llama-3.2-1B-Instruct meta-llama/Llama-3.1-8B-Instruct mistralai/Mistral-7B-Instruct-v0.3
            Qwen/Qwen3-8B Qwen/Qwen2.5-7B-Instruct microsoft/Phi-3-mini-4k-instruct)
fi
RESULTS="$ROOT/benchmarks/results/$(date -u +%Y-%m-%d)-cpu-shipped-cache"
mkdir -p "$RESULTS"

for model in "${MODELS[@]}"; do
    name="${model//\//--}"
    echo "==> $model into $CACHE_DIR"
    start=$(date +%s.%N)
    mirage-serve build-cache "$model" --cache-dir "$CACHE_DIR" --no-package --json > "$RESULTS/$name.json"
    end=$(date +%s.%N)
    python3 - "$RESULTS/$name.json" "$start" "$end" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['model_id']}: {r['counts']} in {float(sys.argv[3]) - float(sys.argv[2]):.1f}s wall")
PY
done

mkdir -p "$ROOT/kernel_cache/entries"
cp "$CACHE_DIR"/entries/*.json "$ROOT/kernel_cache/entries/"
echo "copied $(ls "$CACHE_DIR"/entries/*.json | wc -l) entries to kernel_cache/entries/"
