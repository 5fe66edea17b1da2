"""How fast can any Triton kernel stream decode attention's K/V at batch 1 (Llama-3-8B: 8 KV heads,
head dim 128, bf16)? A bound for the split-KV partials kernel that codegen generates, in one run.

Three hand-written kernel families, written for this measurement only (not shipped, not in the cache):

* ``empty``: the same grid doing nothing but one store: the launch and scheduling cost.
* ``read``: programs over (KV head, split) that load every K and V tile of their split and sum them:
  the pure streaming rate at the same grid shapes, with software pipelining (``num_stages``).
* ``attn``: a minimal split-KV partials kernel (Q K^T, online softmax, P V, on tensor cores),
  with the exact KV length and no masks (``mask=0``) or with the valid-length mask on the scores
  and V (``mask=1``), as codegen's kernel has.
* ``attnT``: the same with both matmuls swapped (keys, then the head dim, on the MMA's M side:
  Hopper's warpgroup MMA needs an M of 64), with ``exp`` or with ``exp2`` and the scale folded into Q;
  only at two or more iterations a program (see ``hand_points``).

Each is timed like ``kernels.py`` times (CUDA-graph replays of a rotation over enough input sets to
defeat the L2; median per call, plain launches), next to codegen's partials kernel alone and its full
two-kernel graph at the 2026-12-04 best schedules, SDPA+graph and, where flashinfer imports,
FlashInfer's ``single_decode_with_kv_cache`` under a graph. ``attn`` points are float-checked
(partials combined in float64 against the float64 reference, outputs NaN-poisoned first); ``read``
against a float64 sum.

Usage: ``python benchmarks/attn_ceiling.py --out DIR [--kv 4096 8192]`` (writes attn-ceiling.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attn_sweep as A  # noqa: E402
import goal_probe as G  # noqa: E402
import kernels as K  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

GROUP = A.Q_HEADS // A.KV_HEADS


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1.0)


@triton.jit
def _read(k_ptr, v_ptr, out_ptr, KV: tl.constexpr, PER: tl.constexpr, T: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):
    h, s = tl.program_id(0), tl.program_id(1)
    rt, rd = tl.arange(0, T), tl.arange(0, D)
    base = h * KV * D + s * PER * D
    acc = tl.zeros((T, D), tl.float32)
    for i in tl.range(0, PER // T, num_stages=STAGES):
        off = base + (i * T + rt[:, None]) * D + rd[None, :]
        acc += tl.load(k_ptr + off).to(tl.float32) + tl.load(v_ptr + off).to(tl.float32)
    tl.store(out_ptr + h * tl.num_programs(1) + s, tl.sum(acc))


@triton.jit
def _attn(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, o_ptr, n_valid, scale, KV: tl.constexpr, PER: tl.constexpr, T: tl.constexpr,
          D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, STAGES: tl.constexpr, MASK: tl.constexpr):
    h, s = tl.program_id(0), tl.program_id(1)
    n_h = tl.num_programs(0)
    rg, rt, rd = tl.arange(0, GP), tl.arange(0, T), tl.arange(0, D)
    q = tl.load(q_ptr + h * G * D + rg[:, None] * D + rd[None, :], mask=rg[:, None] < G, other=0.0)
    m = tl.full((GP,), float("-inf"), tl.float32)
    lsum = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    base = h * KV * D
    for i in tl.range(0, PER // T, num_stages=STAGES):
        key = s * PER + i * T + rt
        k = tl.load(k_ptr + base + key[None, :] * D + rd[:, None])
        v = tl.load(v_ptr + base + key[:, None] * D + rd[None, :])
        sc = tl.dot(q, k) * scale
        if MASK:
            sc = tl.where(key[None, :] < n_valid, sc, float("-inf"))
            v = tl.where(key[:, None] < n_valid, v, 0.0)
        mn = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.where(m == mn, 1.0, tl.exp(m - mn))
        p = tl.exp(sc - mn[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = mn
    row = s * n_h * G + h * G + rg
    tl.store(m_ptr + row, m, mask=rg < G)
    tl.store(l_ptr + row, lsum, mask=rg < G)
    tl.store(o_ptr + row[:, None] * D + rd[None, :], acc, mask=rg[:, None] < G)


@triton.jit
def _attn_t(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, o_ptr, n_valid, scale, KV: tl.constexpr, PER: tl.constexpr, T: tl.constexpr,
            D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, STAGES: tl.constexpr, MASK: tl.constexpr, EXP2: tl.constexpr):
    """``_attn`` with both matmuls swapped: S^T = K Q^T and O^T = V^T P^T, the keys (then the head
    dim) on the MMA's M side, so that an M of 64 or more lets Hopper's warpgroup MMA take them; the
    softmax reduces over axis 0. ``EXP2``: the scale times log2(e) folded into Q, exp2 for exp."""
    h, s = tl.program_id(0), tl.program_id(1)
    n_h = tl.num_programs(0)
    rg, rt, rd = tl.arange(0, GP), tl.arange(0, T), tl.arange(0, D)
    qt = tl.load(q_ptr + h * G * D + rg[None, :] * D + rd[:, None], mask=rg[None, :] < G, other=0.0)
    if EXP2:
        qt = (qt.to(tl.float32) * (scale * 1.4426950408889634)).to(qt.dtype)
    m = tl.full((GP,), float("-inf"), tl.float32)
    lsum = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((D, GP), tl.float32)
    base = h * KV * D
    for i in tl.range(0, PER // T, num_stages=STAGES):
        key = s * PER + i * T + rt
        k = tl.load(k_ptr + base + key[:, None] * D + rd[None, :])
        vt = tl.load(v_ptr + base + key[None, :] * D + rd[:, None])
        st = tl.dot(k, qt)
        if not EXP2:
            st = st * scale
        if MASK:
            st = tl.where(key[:, None] < n_valid, st, float("-inf"))
            vt = tl.where(key[None, :] < n_valid, vt, 0.0)
        mn = tl.maximum(m, tl.max(st, 0))
        if EXP2:
            alpha = tl.where(m == mn, 1.0, tl.exp2(m - mn))
            p = tl.exp2(st - mn[None, :])
        else:
            alpha = tl.where(m == mn, 1.0, tl.exp(m - mn))
            p = tl.exp(st - mn[None, :])
        lsum = lsum * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(vt, p.to(vt.dtype))
        m = mn
    if EXP2:  # the partials' max back in natural-log units, as the combine expects
        m = m * 0.6931471805599453
    row = s * n_h * G + h * G + rg
    tl.store(m_ptr + row, m, mask=rg < G)
    tl.store(l_ptr + row, lsum, mask=rg < G)
    tl.store(o_ptr + row[None, :] * D + rd[:, None], acc, mask=rg[None, :] < G)


def _time(fn, sets, reps):
    from mirage_serve.tune.timing import time_calls

    t = time_calls(fn, sets, cuda_graph=True, reps=reps)
    return {"median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us, "sets": t.sets}


def hand_points(kv: int) -> list[tuple[str, dict]]:
    pts: list[tuple[str, dict]] = []
    for s, t in itertools.product((16, 32, 64, 128), (32, 64, 128)):
        per = kv // s
        if per < t or per % t:
            continue
        loop = per // t
        for w, st in itertools.product((4, 8), (2, 4) if loop > 1 else (1,)) if t >= 64 else ():
            pts.append(("read", {"s": s, "t": t, "num_warps": w, "stages": st}))
        for w, st in itertools.product((2, 4), (2, 3) if loop > 1 else (1,)):
            pts.append(("attn", {"s": s, "t": t, "num_warps": w, "stages": st, "mask": 0}))
        # swapped: only with a pipelined loop; one iteration (num_stages 1) ran into an illegal memory
        # access on an H100 with Triton 3.6 (2026-12-07), which takes down every later point
        for w, st, e2 in itertools.product((4, 8), (2, 3), (0, 1)) if t >= 64 and loop > 1 else ():
            pts.append(("attnT", {"s": s, "t": t, "num_warps": w, "stages": st, "mask": 0, "exp2": e2}))
    return pts


def run_hand(case, kind: str, p: dict, reps: int) -> dict:
    import torch

    from mirage_serve.tune.timing import relative_error

    kv, d, h = case.kv, A.HEAD_DIM, A.KV_HEADS
    s, t, w, st = p["s"], p["t"], p["num_warps"], p["stages"]
    grid = (h, s)
    r: dict = {"kind": kind, **p}
    try:
        if kind == "empty":
            outs = [torch.empty(h * s, device="cuda") for _ in case.sets]
            r.update(_time(lambda o: _empty[grid](o, num_warps=w), [(o,) for o in outs], reps))
        elif kind == "read":
            outs = [torch.empty(h * s, device="cuda", dtype=torch.float32) for _ in case.sets]
            fn = lambda k, v, o: _read[grid](k, v, o, KV=kv, PER=kv // s, T=t, D=d, STAGES=st, num_warps=w)
            sets = [(x[1], x[2], o) for x, o in zip(case.sets, outs, strict=True)]
            fn(*sets[0])
            ref = (sets[0][0].double().sum() + sets[0][1].double().sum()).item()
            r["rel_err"] = abs(outs[0].double().sum().item() - ref) / max(1.0, abs(ref))
            r.update(_time(fn, sets, reps))
        else:
            scale = 1.0 / math.sqrt(d)

            def bufs():
                return (torch.empty(s, h, GROUP, 1, device="cuda"), torch.empty(s, h, GROUP, 1, device="cuda"),
                        torch.empty(s, h, GROUP, d, device="cuda"))

            if kind == "attnT":
                fn = lambda q, k, v, m, ls, o: _attn_t[grid](q, k, v, m, ls, o, kv, scale, KV=kv, PER=kv // s, T=t, D=d, G=GROUP, GP=16,
                                                             STAGES=st, MASK=p["mask"], EXP2=p.get("exp2", 0), num_warps=w)
            else:
                fn = lambda q, k, v, m, ls, o: _attn[grid](q, k, v, m, ls, o, kv, scale, KV=kv, PER=kv // s, T=t, D=d, G=GROUP, GP=16,
                                                           STAGES=st, MASK=p["mask"], num_warps=w)
            errs = []
            for x, ref in zip(case.check_sets, case.refs, strict=True):
                b = bufs()
                for y in b:
                    y.fill_(float("nan"))
                fn(*x, *b)
                torch.cuda.synchronize()
                errs.append(relative_error(G.combine64(*b).reshape(ref.shape), ref))
            r["rel_err"] = max(errs)
            r["passed"] = bool(r["rel_err"] <= 2e-2)
            if r["passed"]:
                r.update(_time(fn, [(*x, *bufs()) for x in case.sets], reps))
    except Exception as e:  # the point loses, with the reason kept
        r.update(passed=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    if r.get("median_us"):
        r["TBps"] = case.floor_bytes / (r["median_us"] * 1e-6) / 1e12
    print(f"  {r.get('median_us', float('nan')):7.2f} us  {r.get('TBps', 0):4.2f} TB/s  err {r.get('rel_err', float('nan')):.1e}  KV {kv} "
          f"{kind} {json.dumps(p)} {r.get('error', '')}", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kv", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    import torch

    from mirage_serve.tune.timing import copy_bandwidth

    t0 = time.time()
    out_path = Path(args.out) / "attn-ceiling.json"
    report: dict = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                                    "cuda": torch.version.cuda, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                    "copy_TBps": copy_bandwidth() / 1e12}, "cases": {}}
    print(json.dumps(report["environment"]), flush=True)
    for kv in args.kv:
        case = A.Case(kv, seed=kv)
        res: dict = {"floor_bytes": case.floor_bytes, "points": []}
        report["cases"][str(kv)] = res
        for s in (32, 64):
            res["points"].append(run_hand(case, "empty", {"s": s, "t": 0, "num_warps": 4, "stages": 1}, args.reps))
        for kind, p in hand_points(kv):
            res["points"].append(run_hand(case, kind, p, args.reps))
        best_attn = min((r for r in res["points"] if r["kind"] == "attn" and r.get("median_us")), key=lambda r: r["median_us"], default=None)
        if best_attn:
            p = {k: best_attn[k] for k in ("s", "t", "num_warps", "stages")}
            res["points"].append(run_hand(case, "attn", {**p, "mask": 1}, args.reps))
        name, params = G.BREAKDOWN[kv]
        res["codegen"] = {"schedule": name, "params": params, "full": A.time_point(case, name, params, args.reps)}
        res["sdpa_graph"] = A.sdpa_point(case, args.reps)
        for fname, tc in (("flashinfer_graph", False), ("flashinfer_tc_graph", True)):
            try:
                fi = K._flashinfer_decode(case.dims, 1.0 / math.sqrt(A.HEAD_DIM), tensor_cores=tc)
                if fi is None:
                    continue
                res[fname] = A.sdpa_point(case, args.reps, fi[0], fname, prepare=fi[1])
                print(f"  {res[fname]['median_us']:7.2f} us  {fname} KV {kv}", flush=True)
            except Exception as e:  # JIT or launch failure: recorded, the rest of the run goes on
                res[fname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"  {fname} failed: {res[fname]['error']}", flush=True)
        print(f"  {res['codegen']['full'].get('median_us', float('nan')):7.2f} us  codegen full {name}; SDPA+graph {res['sdpa_graph']['median_us']:.2f}",
              flush=True)
        out_path.write_text(json.dumps(report, indent=1, default=str))
    report["wall_s"] = time.time() - t0
    out_path.write_text(json.dumps(report, indent=1, default=str))
    for kv, res in report["cases"].items():
        print(f"-- KV {kv}: floor {res['floor_bytes'] / report['environment']['copy_TBps'] / 1e6:.2f} us at the copy bandwidth")
        for kind in ("empty", "read", "attn", "attnT"):
            ranked = sorted((r for r in res["points"] if r["kind"] == kind and r.get("median_us")), key=lambda r: r["median_us"])
            for r in ranked[:3]:
                print(f"   {kind:5s} {r['median_us']:7.2f} us  {r.get('TBps', 0):4.2f} TB/s  s{r['s']} t{r['t']} w{r['num_warps']} st{r['stages']} "
                      f"mask {r.get('mask', '-')}")
        m1 = [r for r in res["points"] if r.get("mask") == 1 and r.get("median_us")]
        if m1:
            print(f"   attn with mask {m1[0]['median_us']:.2f} us")
    print(f"wall {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
