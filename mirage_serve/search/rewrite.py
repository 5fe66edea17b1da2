"""Semantics-preserving rewrites of the μGraphs the search verifies.

Two rewrites turn a verified single-loop kernel into the forms a GPU wants at
serving shapes; both are instances of the axioms in docs/abstract-expressions.md
applied to a whole customized operator, and every graph they produce goes
through the verifier like any other candidate (nothing is kept on the strength
of the rewrite alone):

- :func:`stabilize_exp` (exp shifting): an ``exp(t)`` computed inside the loop
  whose values leave the loop only through ``sum`` / ``sum_last`` accumulators
  becomes ``exp(t - m)`` with ``m`` the running maximum of ``t`` (``max_last``),
  and those accumulators become ``rescaled_sum`` / ``rescaled_sum_last`` with
  ``m``: every accumulated value is then scaled by the same ``exp(-M)``
  (``M`` the final maximum), which the verifier accepts only where the outputs do
  not depend on it (a ratio of such sums, as in a softmax). The values stay
  bounded by 1, so the kernel is safe in bf16 / fp16 whatever the scores.
- :func:`split_loop` (reductions splitting, ``Sum(a*b, x) = Sum(a, Sum(b, x))``
  for a customized operator): the loop of the operator that produces the outputs
  is split over a new grid dim. A first operator runs the loop over one part per
  block and writes every accumulator as a partial result (one slice per part);
  a second reads the partials, merges each accumulator by its own algebra
  (sums add, maxima take the max, rescaled sums are brought to the common
  maximum by ``exp(m_i - M)``, mean squares average) and runs the operators
  that came after the loop. For decode attention this is split-KV
  (flash-decoding); for a norm-matmul it is split-K.

Both work on structures (representative sizes); :func:`variants` lists the
rewrites of a graph, and the driver instantiates and verifies them.
"""

from __future__ import annotations

import logging

from mirage_serve.mugraph.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos

log = logging.getLogger(__name__)

__all__ = ["grid_last_dim", "numerically_safe", "split_loop", "stabilize_exp", "unshifted_exps", "variants"]

_SUMS = {"sum": "rescaled_sum", "sum_last": "rescaled_sum_last"}


def _consumers(block: BlockGraph) -> dict[int, list[int]]:
    """Tile id -> indices of the block ops that read it."""
    n_in = len(block.inputs)
    out: dict[int, list[int]] = {}
    for i, op in enumerate(block.ops):
        for t in op.inputs:
            out.setdefault(t, []).append(i)
    out.setdefault(n_in + len(block.ops) - 1, [])
    return out


# --------------------------------------------------------------------------- exp shifting


def stabilize_exp(block: BlockGraph, kernel_inputs: list[TensorInfo]) -> list[BlockGraph]:
    """One rewritten block per in-loop ``exp`` that leaves the loop only through
    ``sum`` / ``sum_last`` accumulators (see the module docstring); [] if none."""
    try:
        tiles = block_tile_infos(block, kernel_inputs)
    except MuGraphError:
        return []
    n_in = len(block.inputs)
    cons = _consumers(block)
    out: list[BlockGraph] = []
    for i, op in enumerate(block.ops):
        if op.kind != "unary" or op.attr("fn") != "exp" or tiles[n_in + i].phase != "loop":
            continue
        # the tiles computed from this exp inside the loop, and the accumulators that close them
        down, accs, todo, ok = {n_in + i}, set(), [n_in + i], True
        while todo and ok:
            t = todo.pop()
            for j in cons.get(t, []):
                c = block.ops[j]
                if c.kind == "accum":
                    if c.attr("fn") not in _SUMS or c.inputs[0] != t:
                        ok = False
                    accs.add(j)
                elif n_in + j not in down:
                    down.add(n_in + j)
                    todo.append(n_in + j)
        if not ok or not accs or any(bo.tensor in down for bo in block.outputs):
            continue
        new_id: dict[int, int] = {t: t for t in range(n_in)}
        ops: list[Op] = []
        m = -1
        for j, o in enumerate(block.ops):
            ins = tuple(new_id[t] for t in o.inputs)
            if j == i:
                m = n_in + len(ops)
                ops.append(Op.make("accum", (ins[0],), fn="max_last"))
                ops.append(Op.make("binary", (ins[0], m), fn="sub"))
                ops.append(Op.make("unary", (n_in + len(ops) - 1,), fn="exp"))
            elif j in accs:
                ops.append(Op.make("accum", (ins[0], m), fn=_SUMS[o.attr("fn")]))
            else:
                ops.append(Op(o.kind, ins, o.attrs, o.block))
            new_id[n_in + j] = n_in + len(ops) - 1
        nb = BlockGraph(block.grid, block.forloop_range, block.inputs, tuple(ops),
                        tuple(BlockOutput(new_id[bo.tensor], bo.output_map) for bo in block.outputs))
        try:
            block_tile_infos(nb, kernel_inputs)
        except MuGraphError as e:
            log.debug("exp shifting of block op %d gives an invalid block: %s", i, e)
            continue
        out.append(nb)
    return out


# --------------------------------------------------------------------------- loop splitting


def _tile_tags(block: BlockGraph, kernel_inputs: list[TensorInfo], tiles: list[TensorInfo]):
    """The enumerator's partition tags of every tile (None where it has none)."""
    from mirage_serve.search.enumerate import LOOP, Tags, accum_tags, tile_tags

    rank = len(block.grid)
    tags: list = []
    for j, bi in enumerate(block.inputs):
        dims = []
        for d in range(len(tiles[j].shape)):
            s = {f"g{g}" for g in range(rank) if bi.input_map[g] == d}
            if bi.forloop_dim == d:
                s.add(LOOP)
            dims.append(frozenset(s))
        tags.append(Tags(tuple(dims)))
    n_in = len(block.inputs)
    for i, op in enumerate(block.ops):
        ins = [tags[t] for t in op.inputs]
        if any(t is None for t in ins):
            tags.append(None)
        elif op.kind == "accum":
            tags.append(accum_tags(op.attr("fn"), ins[0]))
        else:
            tags.append(tile_tags(op, [tiles[t] for t in op.inputs], ins, tiles[n_in + i]))
    return tags


def split_loop(graph: KernelGraph) -> KernelGraph | None:
    """``graph`` with the loop of its last customized operator split over a new
    grid dim into a partials operator and a merging one (module docstring), at
    representative sizes; None if the operator has no loop or an accumulator
    that does not merge (``rms_last``, ``sum_to``)."""
    from mirage_serve.search.enumerate import _smallest_split, output_map_of

    idx = max((i for i, op in enumerate(graph.ops) if op.kind == "customized"), default=None)
    if idx is None or idx != len(graph.ops) - 1:
        return None
    op = graph.ops[idx]
    block = op.block
    loop_inputs = [bi for bi in block.inputs if bi.forloop_dim >= 0]
    if not loop_inputs or len(block.grid) >= 3:
        return None
    info = graph.info
    kin = [info[t] for t in op.inputs]
    try:
        tiles = block_tile_infos(block, kin)
    except MuGraphError:
        return None
    n_in, rank = len(block.inputs), len(block.grid)
    tags = _tile_tags(block, kin, tiles)

    # the loop extent left to each block, split into (parts, iterations)
    bi0 = loop_inputs[0]
    extent = kin[bi0.source].shape[bi0.forloop_dim]
    for g in range(rank):
        if bi0.input_map[g] == bi0.forloop_dim:
            extent //= block.grid[g]
    parts = _smallest_split(extent)
    if parts >= extent and extent < 4:
        return None
    rest = extent // parts
    rng = _smallest_split(rest) if rest >= 2 else 1

    post = {n_in + i for i, o in enumerate(block.ops) if o.kind != "accum" and tiles[n_in + i].phase == "post"}
    accum_ids = {n_in + i for i, o in enumerate(block.ops) if o.kind == "accum"}
    if any(block.ops[t - n_in].attr("fn") in ("rms_last", "sum_to") for t in accum_ids):
        return None
    # tiles the post-loop part reads from before it: accumulators (merged) and invariant tiles (recomputed)
    needed_acc: list[int] = []
    needed_inv: set[int] = set()
    todo = [bo.tensor for bo in block.outputs] + [t for p in post for t in block.ops[p - n_in].inputs]
    seen: set[int] = set()
    while todo:
        t = todo.pop()
        if t in seen or t in post:
            continue
        seen.add(t)
        if t in accum_ids:
            needed_acc.append(t)
        elif tiles[t].phase == "invariant":
            needed_inv.add(t)
            if t >= n_in:
                todo.extend(block.ops[t - n_in].inputs)
        else:
            return None  # a loop tile or a non-accumulator "both" tile after the loop
    needed_acc.sort()
    maxes = {}
    for t in needed_acc:
        a = block.ops[t - n_in]
        if a.attr("fn").startswith("rescaled"):
            maxes[t] = a.inputs[1]
    partial_tiles = sorted(set(needed_acc) | set(maxes.values()))

    # kernel 1: everything but the post-loop part, writing the accumulators as partials
    omaps = {}
    for t in partial_tiles:
        tg = tags[t]
        om = output_map_of(tg, rank) if tg is not None else None
        if om is None:
            return None
        omaps[t] = om + (-1,)
    keep1: set[int] = set()
    todo = list(partial_tiles)
    while todo:
        t = todo.pop()
        if t in keep1:
            continue
        keep1.add(t)
        if t >= n_in:
            todo.extend(block.ops[t - n_in].inputs)
    k1_inputs = [j for j in range(n_in) if j in keep1]
    new_id = {j: k for k, j in enumerate(k1_inputs)}
    # the new grid dim splits each loop input along its loop dim; other inputs are replicated along it
    binputs = [BlockInput(k, block.inputs[j].input_map + (block.inputs[j].forloop_dim,), block.inputs[j].forloop_dim)
               for k, j in enumerate(k1_inputs)]
    ops1: list[Op] = []
    for i, o in enumerate(block.ops):
        t = n_in + i
        if t not in keep1:
            continue
        ops1.append(Op(o.kind, tuple(new_id[x] for x in o.inputs), o.attrs, o.block))
        new_id[t] = len(k1_inputs) + len(ops1) - 1
    b1 = BlockGraph(block.grid + (parts,), rng, tuple(binputs), tuple(ops1),
                    tuple(BlockOutput(new_id[t], omaps[t]) for t in partial_tiles))
    op1 = Op.make("customized", tuple(op.inputs[block.inputs[j].source] for j in k1_inputs), block=b1)

    # kernel 2: merge the partials, then the post-loop part
    n_prev = graph.num_tensors - op.num_outputs  # tensor ids before the original operator's outputs
    part_tensor = {t: n_prev + k for k, t in enumerate(partial_tiles)}
    inv_inputs = sorted(j for j in needed_inv if j < n_in)
    k2_sources = [part_tensor[t] for t in partial_tiles] + [op.inputs[block.inputs[j].source] for j in inv_inputs]
    b2_inputs = []
    for k, t in enumerate(partial_tiles):
        om = omaps[t][:-1]
        b2_inputs.append(BlockInput(k, tuple(d + 1 if d >= 0 else -1 for d in om), -1))
    for k, j in enumerate(inv_inputs):
        b2_inputs.append(BlockInput(len(partial_tiles) + k, block.inputs[j].input_map, -1))
    n2 = len(b2_inputs)
    ops2: list[Op] = []
    id2: dict[int, int] = {j: len(partial_tiles) + k for k, j in enumerate(inv_inputs)}

    def emit(o: Op) -> int:
        ops2.append(o)
        return n2 + len(ops2) - 1

    src = {t: k for k, t in enumerate(partial_tiles)}
    factor: dict[int, int] = {}
    for m in sorted(set(maxes.values())):
        mx = emit(Op.make("reduce", (src[m],), fn="max", dim=0, keepdim=True))
        factor[m] = emit(Op.make("unary", (emit(Op.make("binary", (src[m], mx), fn="sub")),), fn="exp"))
    parts_f = float(parts)
    for t in needed_acc:
        fn = block.ops[t - n_in].attr("fn")
        x = src[t]
        if fn.startswith("rescaled"):
            x = emit(Op.make("binary", (x, factor[maxes[t]]), fn="mul"))
        if fn == "max_last":
            id2[t] = emit(Op.make("reduce", (x,), fn="max", dim=0, keepdim=False))
            continue
        s = emit(Op.make("reduce", (x,), fn="sum", dim=0, keepdim=False))
        if fn == "mean_sq_last":
            s = emit(Op.make("unary", (s,), fn="mul_scalar", scalar=1.0 / parts_f))
        id2[t] = s
    for i, o in enumerate(block.ops):
        t = n_in + i
        if t in post or (t in needed_inv and t >= n_in):
            id2[t] = emit(Op(o.kind, tuple(id2[x] for x in o.inputs), o.attrs, o.block))
    b2 = BlockGraph(block.grid, 1, tuple(b2_inputs), tuple(ops2),
                    tuple(BlockOutput(id2[bo.tensor], bo.output_map) for bo in block.outputs))
    op2 = Op.make("customized", tuple(k2_sources), block=b2)
    ops = graph.ops[:idx] + (op1, op2)
    # op1's outputs take the ids the original operator's outputs had; op2's follow them
    first_out2 = n_prev + len(partial_tiles)
    remap = {n_prev + k: first_out2 + k for k in range(op.num_outputs)}
    outputs = tuple(remap.get(t, t) for t in graph.outputs)
    try:
        return KernelGraph(ops, outputs).validate()
    except MuGraphError as e:
        log.debug("loop split gives an invalid graph: %s", e)
        return None


def grid_last_dim(graph: KernelGraph) -> list[KernelGraph]:
    """``graph`` with its last customized operator, when it runs no loop, also gridded along the
    last dim of its outputs (at a representative size of 2 blocks), one graph for each way of
    mapping that dim onto its inputs that the partition tags accept: each output varies along the
    new grid dim exactly in its last dim and no block computes a partial result along it. For the
    merge kernel of a loop split (split-KV's combine) this spreads the merge of the head dim over
    more, smaller programs. Every result is only a candidate: the driver verifies it."""
    from itertools import product

    from mirage_serve.mugraph.serialize import content_hash
    from mirage_serve.search.enumerate import output_map_of

    idx = max((i for i, op in enumerate(graph.ops) if op.kind == "customized"), default=None)
    if idx is None or idx != len(graph.ops) - 1:
        return []
    op = graph.ops[idx]
    block = op.block
    rank = len(block.grid)
    if rank >= 3 or any(bi.forloop_dim >= 0 for bi in block.inputs):
        return []
    info = graph.info
    kin = [info[t] for t in op.inputs]
    n_prev = graph.num_tensors - op.num_outputs
    outs = [info[n_prev + k] for k in range(op.num_outputs)]
    extents = {o.shape[-1] for o in outs}
    if len(extents) != 1 or any(len(o.shape) - 1 in bo.output_map for o, bo in zip(outs, block.outputs, strict=True)):
        return []
    (extent,) = extents
    if extent < 4 or extent % 2:
        return []
    choices = []
    for bi in block.inputs:
        shape = kin[bi.source].shape
        choices.append([-1] + [d for d in range(len(shape)) if d not in bi.input_map and shape[d] == extent])
    name = f"g{rank}"
    found: dict[str, KernelGraph] = {}
    for combo in product(*choices):
        if all(d < 0 for d in combo):
            continue
        nb = BlockGraph(block.grid + (2,), block.forloop_range,
                        tuple(BlockInput(bi.source, bi.input_map + (d,), -1) for bi, d in zip(block.inputs, combo, strict=True)),
                        block.ops,
                        tuple(BlockOutput(bo.tensor, bo.output_map + (len(o.shape) - 1,)) for bo, o in zip(block.outputs, outs, strict=True)))
        try:
            g = KernelGraph(graph.ops[:idx] + (Op.make("customized", op.inputs, block=nb),), graph.outputs).validate()
            tiles = block_tile_infos(nb, kin)
        except MuGraphError:
            continue
        tags = _tile_tags(nb, kin, tiles)
        ok = True
        for bo in nb.outputs:
            tg = tags[bo.tensor]
            if tg is None or name in tg.partial or output_map_of(tg, rank + 1) != bo.output_map:
                ok = False
                break
        if ok:
            found.setdefault(content_hash(g), g)
    return list(found.values())


def variants(graph: KernelGraph) -> list[KernelGraph]:
    """The rewrites of a structure worth verifying: exp-shifted forms of its last
    customized operator, and the loop split of the graph and of each shifted form."""
    out: list[KernelGraph] = []
    idx = max((i for i, op in enumerate(graph.ops) if op.kind == "customized"), default=None)
    if idx is None:
        return out
    op = graph.ops[idx]
    info = graph.info
    shifted = []
    for nb in stabilize_exp(op.block, [info[t] for t in op.inputs]):
        g = KernelGraph(graph.ops[:idx] + (Op.make("customized", op.inputs, block=nb),) + graph.ops[idx + 1 :], graph.outputs)
        try:
            shifted.append(g.validate())
        except MuGraphError:
            continue
    out.extend(shifted)
    for g in [graph] + shifted:
        s = split_loop(g)
        if s is not None:
            out.append(s)
            out.extend(grid_last_dim(s))
    return out


# --------------------------------------------------------------------------- numerical safety


def _is_max(op: Op | None) -> bool:
    return op is not None and ((op.kind == "reduce" and op.attr("fn") == "max") or (op.kind == "accum" and op.attr("fn") == "max_last"))


def unshifted_exps(graph: KernelGraph) -> int:
    """How many ``exp`` operators (kernel or block level) do not read ``x - max(...)``.

    A shifted exp is at most 1 wherever the max covers its argument; an unshifted
    one overflows for large arguments (in fp32 above 88, whatever the input dtype)."""

    def count(ops, producer: dict[int, Op]) -> int:
        n = 0
        for o in ops:
            if o.kind == "unary" and o.attr("fn") == "exp":
                arg = producer.get(o.inputs[0])
                n += not (arg is not None and arg.kind == "binary" and arg.attr("fn") == "sub"
                          and _is_max(producer.get(arg.inputs[1])))
        return n

    kernel_producer = {t: graph.ops[i] for t, (i, _) in enumerate(graph.tensor_producers)}
    n = count(graph.ops, kernel_producer)
    for o in graph.customized_ops:
        first = len(o.block.inputs)
        n += count(o.block.ops, {first + i: b for i, b in enumerate(o.block.ops)})
    return n


def numerically_safe(graph: KernelGraph, spec: KernelGraph) -> bool:
    """False if ``graph`` has more unshifted exps than ``spec``: the spec guards its
    exponentials with a max and the candidate drops the guard (an unstable softmax)."""
    return unshifted_exps(graph) <= unshifted_exps(spec)
