"""Serve a tiny model with vllm.LLM offline and write the greedy tokens and plugin stats as JSON.

Usage: python serve_tiny.py MODEL_DIR OUT_JSON [--compile]   (env: MIRAGE_SERVE_CACHE, MIRAGE_SERVE_DISABLE)
Without --compile vLLM runs eagerly; with it, vLLM's torch.compile pipeline runs too.
"""

import json
import logging
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    model_dir, out_path = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    logging.getLogger("mirage_serve").setLevel(logging.INFO)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager="--compile" not in sys.argv[3:],
              max_model_len=128, max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=64 << 20)  # a fixed small KV cache: no share of host memory
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ([1, 5, 9, 13, 17], [2, 4, 8], [7, 7, 7, 7], [30, 1])]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False))
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    from mirage_serve.integrations.vllm import patch

    result["stats"] = patch.stats()
    result["reports"] = [{"replaced": r.replaced, "skipped": r.skipped, "summary": r.summary()} for r in patch.REPORTS]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
