#!/usr/bin/env bash
# `mirage-serve build-cache` on a GPU, end to end, for a small random-config Llama (no weights): search,
# verification, ranking by profiling and the codegen-parameter search (--tune-budget), into a fresh cache
# under $OUT. Writes $OUT/build-cache.json (the command's --json report), build-cache.log and a summary of
# each kernel's tuned parameters against its default-parameter time.
# Usage (GPU machine): [SEEDED=1] bash benchmarks/build_cache_gpu.sh [build-cache args replacing the default slice below]
# (SEEDED=1 keeps the entries shipped with mirage-serve, which then seed the searches; by default --no-package)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/tiny-llama
# what the search needs beyond the GPU image, carried as wheels (bash benchmarks/peer_wheels.sh build; carry [".whl/build"])
if ls .whl/build/*.whl >/dev/null 2>&1; then
  # --no-deps: egglog's declared extras (widgets, notebooks) are not needed to import it; present packages are kept
  python3 -m pip install -q --no-deps --no-index --find-links .whl/build --break-system-packages "egglog>=13.2" black click \
    cloudpickle graphviz mypy-extensions opentelemetry-api importlib-metadata zipp packaging pathspec platformdirs pytokens \
    typing-extensions tqdm filelock 2>&1 | grep -v -i warning | tail -3
  python3 -c 'from egglog.bindings import EGraph' || echo "egglog does not import: build-cache's search will fail"
fi
# this checkout, installed or not: the package maps models/ and kernel_cache/ into mirage_serve; a symlinked copy
# of the tree does the same for this process and the worker processes it spawns (python3 -P: not the cwd's copy)
rm -rf /tmp/msrc && mkdir -p /tmp/msrc/mirage_serve && cp -rs "$PWD"/mirage_serve/. /tmp/msrc/mirage_serve/
ln -sfn "$PWD/models" /tmp/msrc/mirage_serve/models && ln -sfn "$PWD/kernel_cache" /tmp/msrc/mirage_serve/kernel_cache
export PYTHONPATH=/tmp/msrc${PYTHONPATH:+:$PYTHONPATH}
python3 -P -c 'import mirage_serve; print("mirage_serve from", mirage_serve.__file__)'
cat > /tmp/tiny-llama/config.json <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048,
 "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": 128, "torch_dtype": "bfloat16"}
JSON
# the default slice: two kernels at two batches and one KV length, short budgets (extra args override)
args=(--only attn_norm_qkv,attention_decode --batch-sizes 1,8 --kv-lens 1024 --time-budget 120 --patience 8 --tune-budget 40 --jobs 8)
[ $# -gt 0 ] && args=("$@")
# SIGINT at the limit: build-cache stops, keeps what it built and still prints its report (SIGKILL 60 s later)
timeout -s INT -k 60 ${BUILD_TIMEOUT:-450} python3 -P -c 'import sys; from mirage_serve.cli import main; sys.exit(main(sys.argv[1:]))' \
  -v build-cache /tmp/tiny-llama $([ "${SEEDED:-0}" = 1 ] || echo --no-package) --cache-dir "$OUT/cache" --json "${args[@]}" > "$OUT/build-cache.json" 2> "$OUT/build-cache.log"
rc=$?
echo "build-cache exit $rc"
grep "mirage_serve.cmd_build_cache" "$OUT/build-cache.log" | tail -12
python3 - "$OUT/build-cache.json" <<'PY'
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no JSON report (build-cache.log says why)")
for r in rep.get("results", []):
    t = (r.get("details") or {}).get("tuned") or {}
    print(f"{r['subgraph']:<22} {r['bucket']:<12} {r['status']:<8} profiled={r['profiled']} speedup={r['speedup']} "
          f"kept={t.get('kept')} params={t.get('params')} default_us={t.get('default_us')} time_us={t.get('time_us')} "
          f"points={t.get('points')} passed={t.get('passed')} {t.get('seconds')}s not_timed={t.get('not_timed')} {t.get('error', '')}")
PY
exit $rc
