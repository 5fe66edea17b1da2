"""Issue #5's open goal cases in one GPU run: decode attention b1 at KV 4k/8k (the full graph, its
partials kernel alone and its combine alone, so the time over the floor can be placed) and
RMSNorm->QKV at batch 32 (4096->6144), each with the ``stream_evict`` / ``late_ext_mask`` codegen
parameters around the 2026-12-04 winners, against SDPA+graph / cuBLAS+graph and torch.compile+graph.

Every timed point is float-checked against float64 on two input sets (outputs NaN-poisoned first);
the partials kernel alone is checked by combining its partials in float64, the combine alone
against a float64 combine of its (random) partials. Timing as in ``kernels.py``: CUDA-graph replays
of a rotation over enough input sets to defeat the L2, median per call; the best points and the
contenders are re-timed interleaved, twice.

Usage: ``python benchmarks/goal_probe.py --out DIR`` (writes goal-probe.json); with ``--tma`` the
same cases with the ``tma`` codegen parameter (tensor-descriptor loads) against the earlier bests
(writes goal-probe-tma.json); with ``--pdl2`` / ``--dotacc`` the attention points with ``pdl=2`` / ``dot_acc=1``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attn_sweep as A  # noqa: E402
import variants as V  # noqa: E402

from mirage_serve.mugraph import BlockBuilder, GraphBuilder  # noqa: E402

DOT = {"matmul": "dot", "dot_precision": "input"}
ATT = {**DOT, "pdl": 1}
ATT_POINTS = {  # (schedule, params); the first of each is the 2026-12-04 18:49 best
    4096: [("s64 t64 cd8", {**ATT, "late_ext_mask": 2}), ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, "stream_evict": 1}),
           ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, "stream_evict": 2}), ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, "num_warps": 2, "stream_evict": 2}),
           ("s32 t128 cd8", {**ATT, "late_ext_mask": 2, "stream_evict": 2}), ("s64 t64 cd4", {**ATT, "late_ext_mask": 2, "stream_evict": 2})],
    8192: [("s32 t64 cd2", {**ATT, "num_stages": 3}), ("s32 t64 cd2", {**ATT, "num_stages": 3, "stream_evict": 1}),
           ("s32 t64 cd2", {**ATT, "num_stages": 3, "stream_evict": 2}), ("s32 t64 cd2", {**ATT, "num_stages": 4, "stream_evict": 2}),
           ("s32 t64 cd2", {**ATT, "num_stages": 3, "late_ext_mask": 1, "stream_evict": 2}),
           ("s64 t128 cd4", {**ATT, "late_ext_mask": 2, "stream_evict": 2}), ("s64 t128 cd4", {**ATT, "late_ext_mask": 2}),
           ("s32 t128 cd4", {**ATT, "num_stages": 3, "stream_evict": 2})],
}
QKV_BASE = {**DOT, "dot_swap": 1, "num_stages": 4}
QKV_POINTS = [("fused c64 k256", QKV_BASE), ("fused c64 k256", {**QKV_BASE, "stream_evict": 1}), ("fused c64 k256", {**QKV_BASE, "stream_evict": 2}),
              ("fused c64 k256", {**QKV_BASE, "num_stages": 5, "stream_evict": 2}), ("fused c64 k256", {**QKV_BASE, "num_stages": 3, "stream_evict": 2}),
              ("fused c64 k512", {**QKV_BASE, "num_stages": 3, "stream_evict": 2}), ("fused c48 k256", {**QKV_BASE, "stream_evict": 2}),
              ("fused c48 k256", QKV_BASE), ("fused c64 k128", {**QKV_BASE, "stream_evict": 2}),
              ("fused c128 k128", {**QKV_BASE, "num_warps": 8, "stream_evict": 2}),
              ("splitk c64 s2 k256", {**QKV_BASE, "pdl": 1, "stream_evict": 2}), ("splitk c64 s2 k256", {**QKV_BASE, "pdl": 1})]


QKV_POINTS_2 = [("fused c48 k256", {**QKV_BASE, "num_warps": 8, "stream_evict": 2}), ("fused c64 k256", {**QKV_BASE, "num_warps": 8, "stream_evict": 2}),
                ("fused c48 k256", {**QKV_BASE, "k_chunks": 2, "stream_evict": 2}), ("fused c48 k512", {**QKV_BASE, "num_stages": 2, "stream_evict": 2}),
                ("fused c64 k512", {**QKV_BASE, "num_stages": 2, "stream_evict": 2}), ("fused c48 k256", {**QKV_BASE, "num_stages": 3, "stream_evict": 2}),
                ("fused c48 k256", {**QKV_BASE, "stream_evict": 2}), ("fused c48 k256", {**QKV_BASE, "stream_evict": 1}), ("fused c48 k256", QKV_BASE),
                ("fused c64 k256", QKV_BASE)]
# --tma: the same cases through tensor descriptors (``tma=1``); the first point of each is the best before it
TMA = {"tma": 1}
ATT_POINTS_TMA = {
    4096: [("s64 t64 cd8", {**ATT, "late_ext_mask": 2}), ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, **TMA}), ("s64 t64 cd8", {**ATT, **TMA}),
           ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, "num_stages": 3, **TMA}), ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, "num_warps": 2, **TMA}),
           ("s32 t128 cd8", {**ATT, "late_ext_mask": 2, **TMA}), ("s64 t64 cd4", {**ATT, "late_ext_mask": 2, **TMA})],
    8192: [("s32 t64 cd2", {**ATT, "num_stages": 3}), ("s32 t64 cd2", {**ATT, "num_stages": 3, **TMA}), ("s32 t64 cd2", {**ATT, "num_stages": 4, **TMA}),
           ("s32 t64 cd2", {**ATT, "num_stages": 2, **TMA}), ("s32 t64 cd2", {**ATT, "num_stages": 3, "late_ext_mask": 1, **TMA}),
           ("s64 t128 cd4", {**ATT, "late_ext_mask": 2, **TMA}), ("s32 t128 cd4", {**ATT, "num_stages": 3, **TMA}),
           ("s32 t128 cd4", {**ATT, "num_stages": 4, **TMA})],
}
QKV_POINTS_TMA = [("fused c64 k256", QKV_BASE), ("fused c48 k256", {**QKV_BASE, "stream_evict": 2}), ("fused c64 k256", {**QKV_BASE, **TMA}),
                  ("fused c64 k256", {**QKV_BASE, "num_stages": 3, **TMA}), ("fused c64 k128", {**QKV_BASE, "num_stages": 8, **TMA}),
                  ("fused c64 k256", {**QKV_BASE, "num_warps": 8, **TMA}), ("fused c48 k256", {**QKV_BASE, **TMA}),
                  ("fused c64 k128", {**QKV_BASE, **TMA}), ("fused c64 k128", {**QKV_BASE, "num_stages": 6, **TMA}),
                  ("fused c128 k128", {**QKV_BASE, "num_warps": 8, **TMA}), ("fused c128 k128", {**QKV_BASE, "num_warps": 8, "num_stages": 3, **TMA}),
                  ("splitk c64 s2 k256", {**QKV_BASE, "pdl": 1, **TMA})]
# --pdl2: the partials kernel launched plainly, only the combine with PDL (``pdl=2``); the first point of each is the best before it
P2 = {**ATT, "pdl": 2}
ATT_POINTS_PDL2 = {
    4096: [("s64 t64 cd8", {**ATT, "late_ext_mask": 2}), ("s64 t64 cd8", {**P2, "late_ext_mask": 2}), ("s64 t64 cd8", {**ATT}),
           ("s64 t64 cd8", {**P2}), ("s64 t64 cd8", {**P2, "late_ext_mask": 2, "num_warps": 2}), ("s64 t64 cd4", {**P2, "late_ext_mask": 2}),
           ("s32 t128 cd8", {**P2, "late_ext_mask": 2}), ("s64 t32 cd8", {**P2, "late_ext_mask": 2})],
    8192: [("s64 t32 cd8", {**ATT, "late_ext_mask": 1}), ("s64 t32 cd8", {**P2, "late_ext_mask": 1}), ("s32 t64 cd2", {**ATT, "num_stages": 3}),
           ("s32 t64 cd2", {**P2, "num_stages": 3}), ("s64 t32 cd8", {**P2}), ("s64 t64 cd8", {**P2, "late_ext_mask": 1}),
           ("s32 t64 cd4", {**P2, "num_stages": 3, "late_ext_mask": 1})],
}
# --dotacc: the MMA accumulating in place (``dot_acc=1``: acc = dot(p, v, acc * alpha)); the first point of each is the best before it
DA = {"dot_acc": 1}
ATT_POINTS_DOTACC = {
    4096: [("s64 t64 cd8", {**ATT, "late_ext_mask": 2}), ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, **DA}),
           ("s64 t64 cd8", {**ATT, "late_ext_mask": 2, "num_warps": 2, **DA}), ("s32 t128 cd8", {**ATT, "late_ext_mask": 2, **DA})],
    8192: [("s32 t64 cd2", {**ATT, "num_stages": 3}), ("s32 t64 cd2", {**ATT, "num_stages": 3, **DA}), ("s64 t32 cd8", {**ATT, "late_ext_mask": 1}),
           ("s64 t32 cd8", {**ATT, "late_ext_mask": 1, **DA}), ("s32 t64 cd2", {**ATT, "num_stages": 4, **DA}),
           ("s32 t128 cd4", {**ATT, "num_stages": 3, **DA})],
}
BREAKDOWN = {4096: ("s64 t64 cd8", {**ATT, "late_ext_mask": 2}), 8192: ("s32 t64 cd2", {**ATT, "num_stages": 3})}


class _Recorder:
    """Stands in for a compiled Triton kernel: records each launch's grid, arguments and options, then launches it."""

    def __init__(self, fn, log: list) -> None:
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((grid, args, kw))
            return self.fn[grid](*args, **kw)
        return launch


def breakdown(kv: int, reps: int) -> dict:
    """The full graph, its partials kernel alone and its combine alone: the same compiled kernels on the same buffers
    (launches recorded from a call of the graph), each float-checked and timed under CUDA-graph replays."""
    import torch

    from mirage_serve.codegen import compile_graph
    from mirage_serve.tune.profile import make_params
    from mirage_serve.tune.timing import relative_error, time_calls

    name, params = BREAKDOWN[kv]
    case = A.Case(kv, seed=kv + 1)
    cg = compile_graph(A.graph_for(kv, name), make_params(params), V.ATTENTION_VARIABLE_DIMS)
    cg(*case.sets[0])
    torch.cuda.synchronize()
    real = {i: cg._kernel(i, src) for i, src in enumerate(cg._plan.kernels) if src is not None}
    order = sorted(real)
    launches: dict[int, list] = {i: [] for i in order}
    cg._kernel = lambda i, src: _Recorder(real[i], launches[i])
    outs = [cg(*s) for s in case.sets]  # per set: its own partials and output buffers, kept alive by the records
    torch.cuda.synchronize()
    cg._kernel = lambda i, src: real[i]
    k0, k1 = (launches[i] for i in order)
    res: dict = {"kv": kv, "variant": name, "params": params, "floor_us": case.floor_bytes / 4.25e12 * 1e6}
    # checks: kernel 1 alone on poisoned partials (combined in float64), the combine alone on poisoned outputs
    errs0, errs1 = [], []
    for j in (0, 1):
        grid, args, kw = k0[j]
        for t in args[3:6]:
            t.fill_(float("nan"))
        real[order[0]][grid](*args, **kw)
        torch.cuda.synchronize()
        ref = execute_ref(case, j)
        errs0.append(relative_error(combine64(*args[3:6]).reshape(ref.shape), ref))
        grid1, args1, kw1 = k1[j]
        args1[3].fill_(float("nan"))
        real[order[1]][grid1](*args1, **kw1)
        torch.cuda.synchronize()
        errs1.append(relative_error(args1[3], ref))
        errs1.append(relative_error(outs[j][0], ref))  # the same buffer as the combine's output
    res["partials_rel_err"], res["combine_rel_err"] = max(errs0), max(errs1)
    passed = max(errs0 + errs1) <= 2e-2
    res["passed"] = passed
    if passed:
        for label, fn, n in (("full", lambda j: cg(*case.sets[j]), len(case.sets)),
                             ("partials", lambda j: real[order[0]][k0[j][0]](*k0[j][1], **k0[j][2]), len(k0)),
                             ("partials_no_pdl", lambda j: real[order[0]][k0[j][0]](*k0[j][1], **{k: v for k, v in k0[j][2].items() if k != "launch_pdl"}), len(k0)),
                             ("combine", lambda j: real[order[1]][k1[j][0]](*k1[j][1], **k1[j][2]), len(k1)),
                             ("combine_no_pdl", lambda j: real[order[1]][k1[j][0]](*k1[j][1], **{k: v for k, v in k1[j][2].items() if k != "launch_pdl"}), len(k1)),
                             ("full", lambda j: cg(*case.sets[j]), len(case.sets))):
            t = time_calls(fn, [(j,) for j in range(n)], cuda_graph=True, reps=reps)
            res.setdefault(label, []).append(t.median_us)
            print(f"  {t.median_us:7.2f} us  {label} KV {kv} {name} {json.dumps(params)}", flush=True)
        kv_bytes = 2 * A.KV_HEADS * kv * A.HEAD_DIM * 2
        res["partials_TBps"] = kv_bytes / (min(res["partials"]) * 1e-6) / 1e12
    res["sdpa_graph"] = A.sdpa_point(case, reps)
    print(f"  {res['sdpa_graph']['median_us']:7.2f} us  SDPA+graph KV {kv}", flush=True)
    return res


def execute_ref(case, j: int):
    """The float64 reference for ``case.sets[j]`` (``case.refs`` belong to ``case.check_sets``, whose second set is a fresh draw)."""
    import torch

    from mirage_serve.reference import execute

    cache = case.__dict__.setdefault("set_refs", {})
    if j not in cache:
        cache[j] = execute(case.spec, case.sets[j], dtype=torch.float64)[0]
    return cache[j]


def partials_graph(kv: int, name: str):
    """Kernel 1 of ``A.graph_for(kv, name)`` alone: the split-KV partials (max, sum, unnormalised output) as the graph's outputs."""
    s, t, _ = (int(x[2:] if x.startswith("cd") else x[1:]) for x in name.split())
    bk, group, d = A.KV_HEADS, A.Q_HEADS // A.KV_HEADS, A.HEAD_DIM
    g = GraphBuilder()
    q, k, v = g.input("Q", (bk, group, d), A.DTYPE), g.input("K", (bk, kv, d), A.DTYPE), g.input("V", (bk, kv, d), A.DTYPE)
    b = BlockBuilder((bk, s), kv // s // t)
    tq, tk, tv = b.input(0, (0, -1), -1), b.input(1, (0, 1), 1), b.input(2, (0, 1), 1)
    sc = b.unary("mul_scalar", b.matmul(tq, tk, trans_b=True), scalar=1.0 / math.sqrt(d))
    m = b.accum("max_last", sc)
    p = b.unary("exp", b.binary("sub", sc, m))
    lsum = b.accum("rescaled_sum_last", p, m)
    o = b.accum("rescaled_sum", b.matmul(p, tv), m)
    for x in (m, lsum, o):
        b.output(x, (0, -1))
    outs = g.customized([q, k, v], b.build())
    return g.build(list(outs))


def combine_graph(name: str):
    """Kernel 2 of the schedule alone, over float32 partials."""
    s, _, cd = (int(x[2:] if x.startswith("cd") else x[1:]) for x in name.split())
    bk, group, d = A.KV_HEADS, A.Q_HEADS // A.KV_HEADS, A.HEAD_DIM
    g = GraphBuilder()
    pm, pl, po = g.input("M", (s, bk, group, 1), "float32"), g.input("L", (s, bk, group, 1), "float32"), g.input("O", (s, bk, group, d), "float32")
    c = BlockBuilder((bk, cd), 1)
    cm, cl, co = c.input(0, (1, -1), -1), c.input(1, (1, -1), -1), c.input(2, (1, 3), -1)
    mx = c.reduce("max", cm, 0)
    f = c.unary("exp", c.binary("sub", cm, mx))
    num = c.reduce("sum", c.binary("mul", co, f), 0, keepdim=False)
    den = c.reduce("sum", c.binary("mul", cl, f), 0, keepdim=False)
    c.output(c.binary("div", num, den), (0, 2))
    (out,) = g.customized([pm, pl, po], c.build())
    return g.build([out])


def combine64(m, ls, o):
    m, ls, o = m.double(), ls.double(), o.double()
    f = (m - m.amax(0, keepdim=True)).exp()
    return (o * f).sum(0) / (ls * f).sum(0)


def measure(label: str, graph, params: dict, check_sets, check, time_sets, reps: int, variable_dims=()) -> dict:
    """Float-check (``check(outs, set_index) -> rel err``) and time one point."""
    import torch

    from mirage_serve.codegen import compile_graph
    from mirage_serve.tune.profile import make_params
    from mirage_serve.tune.timing import time_calls

    r: dict = {"label": label, "params": params}
    try:
        cg = compile_graph(graph, make_params(params), variable_dims)
        errs = []
        for i, s in enumerate(check_sets):
            outs = cg(*s, poison=True)
            torch.cuda.synchronize()
            errs.append(check(outs, i))
        r["rel_err"] = max(errs)
        r["passed"] = bool(r["rel_err"] <= 2e-2)
        if r["passed"]:
            t = time_calls(cg, time_sets, cuda_graph=True, reps=reps)
            r.update(median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, sets=t.sets, kernels=cg.kernel_stats())
    except Exception as e:  # the point loses, with the reason kept
        r.update(passed=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(f"  {r.get('median_us', float('nan')):7.2f} us  err {r.get('rel_err', float('nan')):.1e}  {label} {json.dumps(params)} {r.get('error', '')}", flush=True)
    return r


def attention(kv: int, reps: int) -> dict:
    import torch

    from mirage_serve.tune.profile import random_device_inputs
    from mirage_serve.tune.timing import relative_error, sets_for

    case = A.Case(kv, seed=kv)
    var = V.ATTENTION_VARIABLE_DIMS
    res: dict = {"kv": kv, "floor_us": case.floor_bytes / 4.25e12 * 1e6, "floor_bytes": case.floor_bytes, "full": [], "partials": [], "combine": []}
    full_check = lambda outs, i: relative_error(outs[0], case.refs[i])
    for name, p in ATT_POINTS[kv]:
        res["full"].append(measure(f"full {name}", A.graph_for(kv, name), p, case.check_sets, full_check, case.sets, reps, var))

    def part_check(outs, i):
        return relative_error(combine64(*outs).reshape(case.refs[i].shape), case.refs[i])

    seen = set()
    for name, p in ATT_POINTS[kv]:
        if (name, json.dumps(p)) in seen:
            continue
        seen.add((name, json.dumps(p)))
        pp = {k: v for k, v in p.items() if k != "pdl"}  # one kernel: no launch overlap to ask for
        res["partials"].append(measure(f"partials {name}", partials_graph(kv, name), pp, case.check_sets, part_check, case.sets, reps, var))
    for name in sorted({n for n, _ in ATT_POINTS[kv]}):
        cg = combine_graph(name)
        gen = torch.Generator(device="cuda").manual_seed(7)
        sets = [random_device_inputs(cg, "cuda", gen) for _ in range(max(2, sets_for(sum(x.numel() * 4 for x in random_device_inputs(cg, "cuda", gen)))))]
        refs = [combine64(*s) for s in sets[:2]]
        res["combine"].append(measure(f"combine {name}", cg, {}, sets[:2], lambda outs, i, refs=refs: relative_error(outs[0], refs[i]), sets, reps))
    ok = [r for r in res["full"] if r.get("median_us")]
    best = min(ok, key=lambda r: r["median_us"])
    res["final"] = {"best": [], "baseline": [], "sdpa_graph": []}
    for _ in range(2):
        res["final"]["sdpa_graph"].append(A.sdpa_point(case, reps * 2))
        res["final"]["best"].append(measure(f"final {best['label']}", A.graph_for(kv, best["label"].split(" ", 1)[1]), best["params"], case.check_sets,
                                            full_check, case.sets, reps * 2, var))
        n0, p0 = ATT_POINTS[kv][0]
        res["final"]["baseline"].append(measure(f"final {n0} (earlier best)", A.graph_for(kv, n0), p0, case.check_sets, full_check, case.sets, reps * 2, var))
    return res


def rmsnorm_inputs(dims: dict, seed: int):
    """RMSNorm->Linear at ``dims`` in bf16 on the GPU: (spec, timing sets defeating the L2, two check
    sets (the first timing set and a fresh draw), their float64 references)."""
    import torch

    from mirage_serve.reference import execute
    from mirage_serve.specs import build_spec
    from mirage_serve.tune.cost_model import floor_bytes
    from mirage_serve.tune.profile import random_device_inputs
    from mirage_serve.tune.timing import sets_for

    spec = build_spec("rmsnorm_linear", dims, dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sets = [random_device_inputs(spec, "cuda", gen) for _ in range(sets_for(floor_bytes(spec)))]
    checks = [sets[0], random_device_inputs(spec, "cuda", gen)]
    refs = [execute(spec, s, dtype=torch.float64)[0] for s in checks]
    return spec, sets, checks, refs


def stock_contender(case, spec, stock: dict, sets: list, cname: str, reps: int) -> dict:
    """One stock contender of ``kernels.py`` (``stock``: its ``_stock_contenders``) float-checked on the
    first two input sets and timed under CUDA-graph replays over all of them."""
    import kernels as K
    import torch

    from mirage_serve.tune.timing import relative_error, time_calls

    fn_or_list, arg_sets, kind = stock[cname]
    fn, args = K._per_set(fn_or_list, arg_sets)
    errs = [relative_error(fn(*args[i]), K._reference(case, spec, sets[i], kind)) for i in range(2)]
    torch.cuda.synchronize()
    t = time_calls(fn, args, cuda_graph=True, reps=reps)
    out = {"label": cname, "rel_err": max(errs), "passed": max(errs) <= 2e-2, "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us}
    print(f"  {t.median_us:7.2f} us  err {max(errs):.1e}  {cname}", flush=True)
    return out


def qkv(reps: int, points=QKV_POINTS) -> dict:
    import kernels as K

    from mirage_serve.tune.cost_model import floor_bytes
    from mirage_serve.tune.timing import relative_error

    dims = {"batch": 32, "hidden": 4096, "out": 6144}
    spec, sets, checks, refs = rmsnorm_inputs(dims, 32)
    cands = {c.name: c for c in V.candidates_for("rmsnorm_linear", dims, "bfloat16")}
    res: dict = {"floor_us": floor_bytes(spec) / 4.25e12 * 1e6, "points": []}
    chk = lambda outs, i: relative_error(outs[0], refs[i])
    for name, p in points:
        res["points"].append(measure(name, cands[name].graph, p, checks, chk, sets, reps))
    case = K.Case("rmsnorm_linear", dims, "qkv b32")
    stock = K._stock_contenders(case, sets)
    contender = lambda cname, r: stock_contender(case, spec, stock, sets, cname, r)

    ok = [r for r in res["points"] if r.get("median_us")]
    best = min(ok, key=lambda r: r["median_us"])
    res["final"] = {"best": [], "baseline": [], "cublas_graph": [], "compile_graph": []}
    for _ in range(2):
        res["final"]["cublas_graph"].append(contender("cublas_graph", reps * 2))
        res["final"]["compile_graph"].append(contender("compile_graph", reps * 2))
        res["final"]["best"].append(measure(f"final {best['label']}", cands[best["label"]].graph, best["params"], checks, chk, sets, reps * 2))
        res["final"]["baseline"].append(measure(f"final {QKV_POINTS[0][0]} (13:40 best)", cands[QKV_POINTS[0][0]].graph, QKV_POINTS[0][1], checks, chk,
                                                sets, reps * 2))
    return res


def precompile(workers: int, second: bool = False) -> None:
    from mirage_serve.tune.search import Candidate, Precompiler, Trial

    var = V.ATTENTION_VARIABLE_DIMS
    cands = {c.name: c for c in V.candidates_for("rmsnorm_linear", {"batch": 32, "hidden": 4096, "out": 6144}, "bfloat16")}
    if second:
        trials = [Trial(Candidate(n, A.graph_for(kv, n), "", var), p, 0) for kv, (n, p) in BREAKDOWN.items()]
        trials += [Trial(cands[n], p, 0) for n, p in QKV_POINTS_2 + QKV_POINTS[:1]]
    else:
        trials = [Trial(Candidate(n, A.graph_for(kv, n), "", var), p, 0) for kv, pts in ATT_POINTS.items() for n, p in pts]
        trials += [Trial(Candidate(n, partials_graph(kv, n), "", var), {k: v for k, v in p.items() if k != "pdl"}, 0)
                   for kv, pts in ATT_POINTS.items() for n, p in pts]
        trials += [Trial(cands[n], p, 0) for n, p in QKV_POINTS]
    pc = Precompiler(workers)
    try:
        pc.compile(trials)
    finally:
        pc.close()
    bad = [(t.candidate.name, t.params, t.compile.get("error")) for t in trials if not t.compile.get("ok")]
    print(f"precompiled {len(trials)} points, {len(bad)} failed: {bad[:4]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--skip-qkv", action="store_true")
    ap.add_argument("--second", action="store_true", help="the breakdown by recorded launches and the second QKV point list")
    ap.add_argument("--tma", action="store_true", help="the tma=1 point lists (ATT_POINTS_TMA, QKV_POINTS_TMA); writes goal-probe-tma.json")
    ap.add_argument("--pdl2", action="store_true", help="the pdl=2 attention points (ATT_POINTS_PDL2); writes goal-probe-pdl2.json")
    ap.add_argument("--dotacc", action="store_true", help="the dot_acc=1 attention points (ATT_POINTS_DOTACC); writes goal-probe-dotacc.json")
    args = ap.parse_args()
    global ATT_POINTS, QKV_POINTS
    if args.tma:
        ATT_POINTS, QKV_POINTS = ATT_POINTS_TMA, QKV_POINTS_TMA
    if args.pdl2:
        ATT_POINTS = ATT_POINTS_PDL2
    if args.dotacc:
        ATT_POINTS = ATT_POINTS_DOTACC
    import torch
    import triton

    from mirage_serve.codegen import CODEGEN_VERSION
    from mirage_serve.tune.timing import copy_bandwidth

    t0 = time.time()
    out = Path(args.out) / ("goal-probe-tma.json" if args.tma else "goal-probe-pdl2.json" if args.pdl2 else "goal-probe-dotacc.json" if args.dotacc
                           else "goal-probe.json")
    report: dict = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                                    "codegen_version": CODEGEN_VERSION, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}}
    save = lambda: out.write_text(json.dumps(report, indent=1, default=str))
    precompile(args.workers, args.second)
    report["copy_bw_Bps"] = copy_bandwidth()
    print(f"copy bandwidth {report['copy_bw_Bps'] / 1e12:.2f} TB/s at +{time.time() - t0:.0f}s", flush=True)
    if args.second:
        out = Path(args.out) / ("goal-probe-2.json" if not args.skip_qkv else "goal-probe-breakdown.json")
        report["breakdown"] = {}
        for kv in (4096, 8192):
            print(f"-- breakdown KV {kv}", flush=True)
            report["breakdown"][str(kv)] = breakdown(kv, args.reps * 2)
            save()
        report["wall_s"] = time.time() - t0
        save()
        if not args.skip_qkv:
            print("-- RMSNorm->QKV b32", flush=True)
            report["qkv_b32"] = qkv(args.reps, QKV_POINTS_2)
            report["wall_s"] = time.time() - t0
            save()
            f = report["qkv_b32"]["final"]
            b, o, cb, cp = (min(x["median_us"] for x in f[k] if x.get("median_us")) for k in ("best", "baseline", "cublas_graph", "compile_graph"))
            print(f"| QKV b32 | {b:.2f} | {f['best'][0]['label']} {json.dumps(f['best'][0]['params'])} | {o:.2f} | cuBLAS {cb:.2f}, compile {cp:.2f} | "
                  f"{b / cb:.3f}x cuBLAS, {cp / b:.3f} compile/ours |")
        for kv, r in report["breakdown"].items():
            print(f"| KV {kv} | full {r.get('full')} | partials {r.get('partials')} ({r.get('partials_TBps', 0):.2f} TB/s) | no pdl {r.get('partials_no_pdl')} | "
                  f"combine {r.get('combine')} | no pdl {r.get('combine_no_pdl')} | SDPA {r['sdpa_graph']['median_us']:.2f} |")
        return 0
    report["attention"] = {}
    for kv in (4096, 8192):
        print(f"-- attention b1 KV {kv}", flush=True)
        report["attention"][str(kv)] = attention(kv, args.reps)
        save()
    if not args.skip_qkv:
        print("-- RMSNorm->QKV b32", flush=True)
        report["qkv_b32"] = qkv(args.reps, QKV_POINTS)
        save()
    report["wall_s"] = time.time() - t0
    save()
    print("| case | ours best | variant | baseline (old best) | contenders | ratio |")
    for kv, r in report["attention"].items():
        f = r["final"]
        b, o, s = (min(x["median_us"] for x in f[k] if x.get("median_us")) for k in ("best", "baseline", "sdpa_graph"))
        print(f"| attn KV {kv} | {b:.2f} | {f['best'][0]['label']} {json.dumps(f['best'][0]['params'])} | {o:.2f} | SDPA+graph {s:.2f} | {s / b:.3f} |")
        for x in r["partials"] + r["combine"]:
            if x.get("median_us"):
                print(f"|   {x['label']} | {x['median_us']:.2f} | {json.dumps(x['params'])} | | | |")
    if "qkv_b32" in report:
        f = report["qkv_b32"]["final"]
        b, o, cb, cp = (min(x["median_us"] for x in f[k] if x.get("median_us")) for k in ("best", "baseline", "cublas_graph", "compile_graph"))
        print(f"| QKV b32 | {b:.2f} | {f['best'][0]['label']} {json.dumps(f['best'][0]['params'])} | {o:.2f} | cuBLAS {cb:.2f}, compile {cp:.2f} | "
              f"{b / cb:.3f}x cuBLAS, {cp / b:.3f} compile/ours |")
    print(f"wall {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
