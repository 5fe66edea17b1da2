#!/usr/bin/env bash
# `mirage-serve build-cache` on a GPU, end to end, for a small random-config Llama (no weights): search,
# verification, ranking by profiling and the codegen-parameter search (--tune-budget), into a fresh cache
# under $OUT. Writes $OUT/build-cache.json (the command's --json report), build-cache.log and a summary of
# each kernel's tuned parameters against its default-parameter time.
# Usage (GPU machine): bash benchmarks/build_cache_gpu.sh [extra build-cache args]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/tiny-llama
cat > /tmp/tiny-llama/config.json <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048,
 "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": 128, "torch_dtype": "bfloat16"}
JSON
timeout ${BUILD_TIMEOUT:-300} python3 -c 'import sys; from mirage_serve.cli import main; sys.exit(main(sys.argv[1:]))' \
  build-cache /tmp/tiny-llama --no-package --cache-dir "$OUT/cache" --json "$@" > "$OUT/build-cache.json" 2> "$OUT/build-cache.log"
echo "build-cache exit $?"
grep -v -i warning "$OUT/build-cache.log" | tail -8
python3 - "$OUT/build-cache.json" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
for r in rep.get("results", []):
    t = (r.get("details") or {}).get("tuned") or {}
    print(f"{r['subgraph']:<22} {r['bucket']:<12} {r['status']:<8} profiled={r['profiled']} speedup={r['speedup']} "
          f"tuned={t.get('params')} kept={t.get('kept', 'tuned')} points={t.get('points')} {t.get('seconds')}s")
PY
