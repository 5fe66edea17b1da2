"""The codegen parameters worth trying for a μGraph, and their neighbours.

The μGraph fixes the tiling (grid, loop range, tile sizes); codegen still has
knobs (:class:`mirage_serve.codegen.CodegenParams`). What is worth trying
follows from a few features of the graph, never from the benchmark case:

* **matmul math.** Tile matmuls with one row are GEMV-shaped: broadcast-multiply
  -reduce on the CUDA cores (``fma``) is the only sensible lowering. With 2 rows
  or more, ``tl.dot`` on the 16-bit operands (``matmul="dot"``,
  ``dot_precision="input"``, rows padded to 16) is tried in both MMA
  orientations, and ``fma`` next to it while its 3-D broadcast product fits in
  registers (:data:`FMA_MAX_PRODUCT`); for one row, the swapped dot (the weight
  tile as the MMA's M side) next to ``fma``. The profile decides.
* **no swapped MMA into a max.** Where a max (softmax's running max) reads a tile matmul's
  result, the swapped orientation is not tried: with the NaN-propagating max reductions, Triton
  3.6 compiled such kernels into illegal memory accesses and wrong results on the H200
  (2026-12-03; the same kernels in the plain orientation, and with ``tl.max`` before, were right).
* **launch overlap.** Graphs of more than one kernel start with programmatic
  dependent launch on (``pdl=1``); the neighbours turn it off. ``pdl=2`` (the first kernel
  launched plainly) is not tried: it was slower than ``pdl=1`` at all four paired attention points
  of the 2026-12-06 H100 run (``benchmarks/results/2026-12-06-h100-goal-probe-pdl2.*``).
* **one launch for partials and their combine.** Where the graph is a partials kernel and a
  combine that reads only its outputs (split-KV attention), every first-round point is also tried
  with ``fused_combine=1`` (the last program of each group to finish runs the combine): it saves a
  launch and the combine's wait at the price of a serial combine tail per group.
* **loads that do not wait for the valid length.** Where a kernel loads a graph input with a
  variable extent (``variable_dims``: the KV length of decode attention), ``late_ext_mask`` bounds
  those loads by the tensor's size instead of the length read from memory. With one loop iteration
  a program the length read sits on the critical path, so every first-round point is also tried
  with ``late_ext_mask=2`` (2026-12-04 H200: 5.2 -> 4.8 µs at KV 1k, 9.5 -> 8.2 at 4k); with
  several iterations the read is hidden behind the first and zeroing V each iteration cost more
  than it saved (8k: 14.1 against 13.6), so there only the neighbours try it (1 and 2).
* **the MMA's own accumulator.** Where a loop's tile matmul is read only by a sum accumulator
  (``summed_matmul``), every first-round dot point is also tried with ``dot_acc=1``
  (``acc = tl.dot(a, b, acc)``): with both operands streamed straight from memory into the MMA (a
  plain tiled matmul), Triton then keeps the MMA in flight across iterations instead of waiting for
  it in each one (sm_90 TTGIR: ``warp_group_dot_wait {pendings = 1}`` against 0); where an operand
  passes through registers first (the one-kernel RMSNorm, whose X is scaled in the loop) it waits
  either way. The neighbours turn it on or off.
* **neighbours** of a (graph, params) point change one knob each: warps 2↔4↔8,
  software-pipelining depth (2-5 stages), programmatic dependent launch for graphs of more
  than one kernel, the swapped MMA orientation for dots, a split of the loop
  into chunks, ``late_ext_mask`` where a kernel loads a variable-extent input. :func:`mirage_serve.tune.search.tune` walks them from the best
  points of a first round.
"""

from __future__ import annotations

from typing import Any

from mirage_serve.codegen.params import GEMV_PRODUCT_PER_THREAD
from mirage_serve.mugraph.graph import KernelGraph
from mirage_serve.mugraph.shapes import block_tile_infos

DOT_NATIVE = {"matmul": "dot", "dot_precision": "input"}


def block_matmuls(block, ins: list) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of every tile matmul of ``block``, whose inputs have the tensor infos ``ins``."""
    tiles = block_tile_infos(block, ins)
    out = []
    for bop in block.ops:
        if bop.kind == "matmul":
            a, b = tiles[bop.inputs[0]].shape, tiles[bop.inputs[1]].shape
            out.append((a[-2] if len(a) >= 2 else 1, b[-2] if bop.attr("trans_b") else b[-1], a[-1]))
    return out


def tile_matmuls(graph: KernelGraph) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of every tile matmul in ``graph``'s block graphs."""
    return [mm for op in graph.ops if op.kind == "customized" for mm in block_matmuls(op.block, [graph.info[t] for t in op.inputs])]


def graph_features(graph: KernelGraph, variable_dims: tuple[tuple[int, int], ...] = ()) -> dict[str, Any]:
    """Rows of the widest tile matmul, the largest broadcast product a GEMV-style lowering of a
    tile matmul holds in registers, kernel count, loop ranges and 16-bit-ness of ``graph``; with
    ``variable_dims`` ((input position, dim) pairs, as for ``compile_graph``), ``variable_loop``: the
    longest loop of a kernel that loads a variable-extent input (0: no kernel does)."""
    info = graph.info
    var_inputs = {graph.input_ids[p] for p, _ in variable_dims if p < len(graph.input_ids)}
    rows, prod, loops, kernels, var_loop = 0, 0, [], 0, 0
    for op in graph.ops:
        if op.kind != "customized":
            continue
        kernels += 1
        blk = op.block
        loops.append(blk.forloop_range)
        if var_inputs & set(op.inputs):
            var_loop = max(var_loop, blk.forloop_range)
        for m, n, k in block_matmuls(blk, [info[t] for t in op.inputs]):
            rows = max(rows, m)
            prod = max(prod, m * n * k)
    low = any(info[t].dtype in ("bfloat16", "float16") for t in graph.input_ids)
    from mirage_serve.codegen.runtime import fusable_combine

    return {"matmul_rows": rows, "fma_product": prod, "kernels": kernels, "max_loop": max(loops, default=1), "low_precision": low,
            "dot_into_max": any(_dot_into_max(op.block) for op in graph.ops if op.kind == "customized"),
            "summed_matmul": any(_summed_matmul(op.block) for op in graph.ops if op.kind == "customized"),
            "fusable_combine": kernels == 2 and fusable_combine(graph)[0] is not None, "variable_loop": var_loop}


def _dot_into_max(block) -> bool:
    """Whether a max (a max reduction or running-max accumulator) reads a tile matmul's result, directly or through other ops."""
    n_in = len(block.inputs)
    from_mm: set[int] = set()
    for j, op in enumerate(block.ops):
        t = n_in + j
        if op.kind == "matmul" or any(x in from_mm for x in op.inputs):
            from_mm.add(t)
            if (op.kind == "reduce" and op.attr("fn") == "max") or (op.kind == "accum" and op.attr("fn") == "max_last"):
                if op.kind != "matmul":
                    return True
    return False


def _summed_matmul(block) -> bool:
    """Whether a loop's tile matmul is read only by a sum accumulator (where ``dot_acc`` can apply)."""
    from mirage_serve.codegen.analysis import summed_matmuls

    return block.forloop_range > 1 and bool(summed_matmuls(block))


#: Elements of a GEMV-style broadcast product (rows x columns x inner) above which fma code
#: spills registers at 4 warps (128 per thread); such points are tried only without an alternative.
FMA_MAX_PRODUCT = GEMV_PRODUCT_PER_THREAD * 32 * 4


def initial_params(graph: KernelGraph, variable_dims: tuple[tuple[int, int], ...] = ()) -> list[dict[str, Any]]:
    """First-round parameter sets for ``graph`` whose ``variable_dims`` may vary at run time (see the module docstring)."""
    f = graph_features(graph, variable_dims)
    dot = dict(DOT_NATIVE) if f["low_precision"] else {"matmul": "dot"}
    if f["max_loop"] > 1:
        dot["num_stages"] = 3
    swapped = [{**dot, "dot_swap": 1}] if not f["dot_into_max"] else []
    if f["matmul_rows"] <= 1:  # GEMV-shaped; a dot pads the row to 16, worth it only with the weight as the MMA's M side
        out = [{"matmul": "fma"}, *swapped] if f["low_precision"] else [{"matmul": "fma"}]
    else:
        out = ([{"matmul": "fma"}] if f["fma_product"] <= FMA_MAX_PRODUCT else []) + [dot, *swapped]
    if f["summed_matmul"]:  # the MMA accumulating in place, which Triton can keep in flight across iterations
        out += [{**p, "dot_acc": 1} for p in out if p.get("matmul") == "dot"]
    if f["kernels"] > 1:  # overlapping each launch with the kernel before it paid at every multi-kernel point of the 2026-12-03 run
        out = [{**p, "pdl": 1} for p in out]
    if f["fusable_combine"]:
        out += [{**p, "fused_combine": 1} for p in out]
    if f["variable_loop"] == 1:  # the valid length's read would sit before every load of the one iteration
        out += [{**p, "late_ext_mask": 2} for p in out]
    return out


def neighbours(graph: KernelGraph, params: dict[str, Any], variable_dims: tuple[tuple[int, int], ...] = ()) -> list[dict[str, Any]]:
    """Parameter sets one knob away from ``params`` that can matter for ``graph`` (``variable_dims`` as for :func:`initial_params`)."""
    f = graph_features(graph, variable_dims)
    p = dict(params)
    out: list[dict[str, Any]] = []

    def with_(**kw: Any) -> None:
        q = {**p, **kw}
        q = {k: v for k, v in q.items() if not (k in _DEFAULTS and v == _DEFAULTS[k])}
        if q != {k: v for k, v in p.items() if not (k in _DEFAULTS and v == _DEFAULTS[k])} and q not in out:
            out.append(q)

    w = p.get("num_warps", 4)
    for nw in {2: (4,), 4: (2, 8), 8: (4,)}.get(w, (4,)):
        with_(num_warps=nw)
    if f["max_loop"] > 1:
        st = p.get("num_stages", 2)
        for s in (2, 3, 4, 5):
            if s != st:
                with_(num_stages=s)
    if f["kernels"] > 1:
        with_(pdl=0 if p.get("pdl", 0) else 1)
    if p.get("matmul") == "dot" and (p.get("dot_swap", 0) or not f["dot_into_max"]):
        with_(dot_swap=0 if p.get("dot_swap", 0) else 1)
    if f["summed_matmul"] and p.get("matmul") == "dot":
        with_(dot_acc=0 if p.get("dot_acc", 0) else 1)
    if f["max_loop"] >= 1 and p.get("k_chunks", 1) == 1:
        with_(k_chunks=2)
    if f["fusable_combine"]:
        with_(fused_combine=0 if p.get("fused_combine", 0) else 1)
    if f["variable_loop"]:
        for m in (0, 1, 2):
            if m != p.get("late_ext_mask", 0):
                with_(late_ext_mask=m)
    return out


def merge(base: dict[str, Any], better: list[dict[str, Any]]) -> dict[str, Any]:
    """``base`` with every knob that some neighbour in ``better`` changed for the better."""
    out = dict(base)
    for q in better:
        for k, v in q.items():
            if base.get(k, _DEFAULTS.get(k)) != v:
                out[k] = v
    return out


_DEFAULTS: dict[str, Any] = {"num_warps": 4, "num_stages": 2, "pdl": 0, "dot_swap": 0, "k_chunks": 1, "fused_combine": 0, "late_ext_mask": 0, "dot_acc": 0}
