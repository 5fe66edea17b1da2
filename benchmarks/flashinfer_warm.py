"""Compile FlashInfer's decode kernels once, before any timing, and check them against float64.

FlashInfer builds its kernels on first use (JIT, nvcc). ``h200_run.sh`` runs this under a timeout
before its steps, so that compile time is neither charged to a timed step nor able to use up a
call's time limit; the compiled modules stay in ``FLASHINFER_WORKSPACE_BASE`` for the steps after.
Exit status 0 only when the paths the benchmarks use (CUDA-core and tensor-core decode at batch 1
and 8, bf16, head dim 128, 32 q / 8 KV heads, a paged cache) compiled and matched the reference.

Usage: ``python benchmarks/flashinfer_warm.py [--kv-len 256]`` (needs a GPU and flashinfer).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-len", type=int, default=256)
    args = p.parse_args(argv)
    import torch

    from mirage_serve.cmd_bench import load_bench

    K = load_bench("kernels")  # by path: a `kernels` package (Hugging Face's) may be imported already

    hq, hk, dh, L = 32, 8, 128, args.kv_len
    scale = 1.0 / math.sqrt(dh)
    ok = True
    for b, tc in itertools.product((1, 8), (False, True)):
        d = {"batch": b, "q_heads": hq, "kv_heads": hk, "kv_len": L, "head_dim": dh}
        what = f"batch {b}, {'tensor-core' if tc else 'CUDA-core'} path"
        t0 = time.perf_counter()
        try:
            fi = K._flashinfer_decode(d, scale, tensor_cores=tc)
            if fi is None:
                print("flashinfer does not import", flush=True)
                return 1
            g = torch.Generator(device="cuda").manual_seed(b)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
                       for shape in ((b, hq, 1, dh), (b, hk, L, dh), (b, hk, L, dh)))
            out = fi[0](*fi[1](q, k, v))
            torch.cuda.synchronize()
        except Exception as e:  # reported, not raised: the benchmarks then run without this contender
            print(f"{what}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            ok = False
            continue
        kr, vr = (t.double().repeat_interleave(hq // hk, 1) for t in (k, v))
        ref = torch.softmax(q.double() @ kr.transpose(-1, -2) * scale, -1) @ vr
        err = ((out.double() - ref).norm() / ref.norm()).item()
        good = math.isfinite(err) and err < 2e-2
        ok &= good
        print(f"{what}: compiled and ran in {time.perf_counter() - t0:.1f} s, relative error {err:.1e}"
              f" {'ok' if good else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
