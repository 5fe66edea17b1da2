"""Random kernel graphs of pre-defined operators, their equivalent rewrites and mutants.

* :func:`random_kernel_graph`: inputs of random shapes (rank 1..3, tiny dims)
  and a chain of operators (element-wise, broadcasting, matmul, reductions over
  any dim, rms_norm with or without a weight, concat), each checked by the IR's
  shape rules; sqrt, rsqrt, recip and division only see values the generator
  knows to be positive, so ordinary runs stay finite.
* :func:`rewrite`: an identity applied at one operator (commuted operands,
  ``a - b = a + (-b)``, ``a / b = a * recip(b)``, ``exp(a + b) = exp(a) exp(b)``,
  sums of sums, rms_norm spelled out, ``(x - y) + y``, dyadic scalings): the
  result computes the same function, exactly in the verifier's model.
* :func:`mutate`: one random change at either level (an operator's function,
  operands, scalar, eps, reduction, accumulator, input/output maps, loop dim,
  trans_b, a dropped operator); whether the mutant still computes the same
  function is decided by the float64 reference, not assumed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from mirage_serve.mugraph.graph import (
    BINARY_FNS,
    UNARY_FNS,
    BlockGraph,
    BlockInput,
    BlockOutput,
    GraphBuilder,
    KernelGraph,
    MuGraphError,
    Op,
)
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos, infer_tile_op

DIMS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def random_kernel_graph(rng: random.Random, dtype: str | None = None, max_ops: int = 7) -> KernelGraph:
    """A random valid kernel graph of pre-defined operators (see the module docstring)."""
    dtype = dtype or rng.choice(("float32", "float32", "bfloat16", "float16"))
    g = GraphBuilder()
    infos: list[TensorInfo] = []
    pos: list[bool] = []
    base = [rng.choice(DIMS) for _ in range(3)]
    for j in range(rng.randint(1, 3)):
        rank = rng.choice((1, 2, 2, 3))
        shape = tuple(base[3 - rank :])
        if rng.random() < 0.3:  # a broadcasting operand
            shape = tuple(1 if rng.random() < 0.4 else s for s in shape)
        if rng.random() < 0.2:  # a matmul partner
            shape = shape[:-2] + (shape[-1], rng.choice(DIMS)) if len(shape) >= 2 else shape
        g.input(f"x{j}", shape, dtype)
        infos.append(TensorInfo(shape, dtype))
        pos.append(False)
    n_ops = rng.randint(1, max_ops)
    tries = 0
    n_inputs = len(infos)
    while len(infos) - n_inputs < n_ops and tries < 200:
        tries += 1
        op = _random_op(rng, infos, pos)
        if op is None:
            continue
        try:
            info = infer_tile_op(op, [infos[t] for t in op.inputs], "fuzz")
        except MuGraphError:
            continue
        if not 1 <= len(info.shape) <= 4 or _numel(info.shape) > 2048:
            continue
        g._add(op)
        infos.append(info)
        pos.append(_positive(op, pos))
    outs = [len(infos) - 1]
    if len(infos) > 2 and rng.random() < 0.3:
        outs.append(rng.randrange(len(infos) - 1))
    return g.build(sorted(set(outs)))


def _positive(op: Op, pos: list[bool]) -> bool:
    if op.kind == "unary":
        fn = op.attr("fn")
        x = pos[op.inputs[0]]
        return fn == "exp" or (fn in ("sqrt", "rsqrt", "recip", "square") and x) or (fn == "add_scalar" and x and op.attr("scalar") > 0)
    if op.kind == "binary":
        return op.attr("fn") in ("add", "mul", "div") and all(pos[t] for t in op.inputs)
    if op.kind == "reduce":
        return pos[op.inputs[0]]
    return False


def _random_op(rng: random.Random, infos: list[TensorInfo], pos: list[bool]) -> Op | None:
    n = len(infos)
    last = n - 1 if rng.random() < 0.6 else rng.randrange(n)
    r = rng.random()
    if r < 0.3:
        fn = rng.choice(UNARY_FNS)
        if fn in ("sqrt", "rsqrt", "recip") and not pos[last]:
            fn = rng.choice(("exp", "square"))
        scalar = rng.choice((0.5, 2.0, -1.0, 0.3, 1.5, -0.25)) if fn in ("mul_scalar", "add_scalar") else None
        if fn == "add_scalar" and pos[last]:
            scalar = abs(scalar)
        return Op.make("unary", (last,), fn=fn, scalar=scalar)
    if r < 0.6:
        other = rng.randrange(n)
        fn = rng.choice(BINARY_FNS)
        a, b = (last, other) if rng.random() < 0.6 else (other, last)
        if fn == "div" and not pos[b]:
            fn = rng.choice(("add", "mul", "sub"))
        return Op.make("binary", (a, b), fn=fn)
    if r < 0.72:
        other = rng.randrange(n)
        return Op.make("matmul", (last, other), trans_b=rng.random() < 0.5 or None)
    if r < 0.85:
        rank = len(infos[last].shape)
        return Op.make("reduce", (last,), fn=rng.choice(("sum", "sum", "max")), dim=rng.randrange(-rank, rank), keepdim=rng.random() < 0.6)
    if r < 0.95:
        ws = [t for t in range(n) if infos[t].shape[-1] == infos[last].shape[-1] and len(infos[t].shape) <= len(infos[last].shape)]
        w = rng.choice(ws) if ws and rng.random() < 0.6 else None
        return Op.make("rms_norm", (last,) if w is None else (last, w), eps=rng.choice((1e-6, 1e-5, 0.1)))
    other = rng.randrange(n)
    rank = len(infos[last].shape)
    return Op.make("concat", (last, other), dim=rng.randrange(-rank, rank))


# ----------------------------------------------------------------------------- rewrites


def _exact(c: float) -> bool:
    from mirage_serve.verify.field import _exact_rational

    return _exact_rational(float(c)) is not None


def _alternatives(op: Op, ins: list[int], infos: list[TensorInfo], producers: list[Op | None], rng: random.Random):
    """Ways to compute ``op`` on (new) tensors ``ins``: callables emitting ops into a builder."""
    k, fn = op.kind, op.attr("fn")
    alts: list[tuple[str, Callable[[GraphBuilder], int]]] = []
    if k == "binary" and fn in ("add", "mul") and infos[0].dtype == infos[1].dtype:
        alts.append((f"commute {fn}", lambda g: g.binary(fn, ins[1], ins[0])))
    if k == "binary" and fn == "sub":
        alts.append(("a-b = a+(-b)", lambda g: g.binary("add", ins[0], g.unary("neg", ins[1]))))
        if infos[0].dtype == infos[1].dtype:
            alts.append(("a-b = -(b-a)", lambda g: g.unary("neg", g.binary("sub", ins[1], ins[0]))))
    if k == "binary" and fn == "div":
        alts.append(("a/b = a*recip(b)", lambda g: g.binary("mul", ins[0], g.unary("recip", ins[1]))))
    if k == "unary" and fn == "square":
        alts.append(("square = x*x", lambda g: g.binary("mul", ins[0], ins[0])))
    if k == "unary" and fn == "rsqrt":
        alts.append(("rsqrt = recip(sqrt)", lambda g: g.unary("recip", g.unary("sqrt", ins[0]))))
    if k == "unary" and fn == "neg":
        alts.append(("-x = x*-1", lambda g: g.unary("mul_scalar", ins[0], scalar=-1.0)))
    if k == "unary" and fn == "mul_scalar":
        c = op.attr("scalar")
        if c == 2.0:
            alts.append(("2x = x+x", lambda g: g.binary("add", ins[0], ins[0])))
        if _exact(-c):
            alts.append(("cx = (-c)(-x)", lambda g: g.unary("mul_scalar", g.unary("neg", ins[0]), scalar=-c)))
    if k == "unary" and fn == "add_scalar" and _exact(-op.attr("scalar")):
        c = op.attr("scalar")
        alts.append(("x+c = -((-x)+(-c))", lambda g: g.unary("neg", g.unary("add_scalar", g.unary("neg", ins[0]), scalar=-c))))
    if k == "unary" and fn == "exp" and producers[0] is not None and producers[0].kind == "binary" and producers[0].attr("fn") in ("add", "sub"):
        alts.append(("exp(a±b) = exp(a)·exp(±b)", ("exp-split", producers[0])))
    if k == "reduce" and fn == "sum" and producers[0] is not None and producers[0].kind == "binary" and producers[0].attr("fn") in ("add", "sub"):
        alts.append(("sum(a±b) = sum(a)±sum(b)", ("sum-split", producers[0])))
    if k == "rms_norm":
        n = infos[0].shape[-1]
        eps = op.attr("eps", 0.0)

        def spelled(g: GraphBuilder) -> int:
            ms = g.unary("mul_scalar", g.reduce("sum", g.unary("square", ins[0]), -1), scalar=1.0 / n)
            y = g.binary("mul", ins[0], g.unary("rsqrt", g.unary("add_scalar", ms, scalar=eps)))
            return g.binary("mul", y, ins[1]) if len(ins) > 1 else y

        if n < 1 << 16:
            alts.append(("rms_norm spelled out", spelled))
    if k in ("unary", "binary", "matmul", "reduce", "rms_norm"):
        alts.append(("y = (y*2)*0.5", ("scale", None)))
    return alts


def rewrite(graph: KernelGraph, rng: random.Random, count: int = 1) -> tuple[KernelGraph, list[str]]:
    """``graph`` with ``count`` identities applied at random operators (kernel level only;
    customized operators are copied unchanged). Returns the new graph and what was applied."""
    applied: list[str] = []
    for _ in range(count):
        graph, what = _rewrite_once(graph, rng)
        if what:
            applied.append(what)
    return graph, applied


def _rewrite_once(graph: KernelGraph, rng: random.Random) -> tuple[KernelGraph, str]:
    info = graph.info
    prod = {t: graph.ops[i] if graph.ops[i].kind not in ("input", "customized") else None for t, (i, _) in enumerate(graph.tensor_producers)}
    sites = []
    for i, op in enumerate(graph.ops):
        if op.kind in ("input", "customized"):
            continue
        alts = _alternatives(op, list(op.inputs), [info[x] for x in op.inputs], [prod.get(x) for x in op.inputs], rng)
        for name, how in alts:
            sites.append((i, name, how))
    if not sites:
        return graph, ""
    weights = [0.15 if name.startswith("y = (y*2)") else 1.0 for _, name, _ in sites]
    site_i, name, how = rng.choices(sites, weights)[0]
    g = GraphBuilder()
    env: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        first = graph.tensor_producers.index((i, 0))
        ins = [env[x] for x in op.inputs]
        if i != site_i:
            new = g._add(Op.make(op.kind, tuple(ins), block=op.block, **op.a))
            if op.kind == "customized":
                for j, t in enumerate(new):
                    env[first + j] = t
            else:
                env[first] = new
            continue
        if callable(how):
            env[first] = how(g)
        elif how[0] == "exp-split":
            p = how[1]
            a, b = (env[x] for x in p.inputs)
            eb = g.unary("exp", b) if p.attr("fn") == "add" else g.unary("exp", g.unary("neg", b))
            env[first] = g.binary("mul", g.unary("exp", a), eb)
        elif how[0] == "sum-split":
            p = how[1]
            a, b = (env[x] for x in p.inputs)
            if info[p.inputs[0]].shape != info[p.inputs[1]].shape:
                env[first] = g._add(Op.make(op.kind, tuple(ins), **op.a))
                name = ""
            else:
                sa = g.reduce("sum", a, op.attr("dim", -1), op.attr("keepdim", True))
                sb = g.reduce("sum", b, op.attr("dim", -1), op.attr("keepdim", True))
                env[first] = g.binary(p.attr("fn"), sa, sb)
        else:  # scale
            y = g._add(Op.make(op.kind, tuple(ins), **op.a))
            env[first] = g.unary("mul_scalar", g.unary("mul_scalar", y, scalar=2.0), scalar=0.5)
    return g.build([env[t] for t in graph.outputs]), name


# ----------------------------------------------------------------------------- mutations


def _with_kernel_op(graph: KernelGraph, i: int, op: Op) -> KernelGraph:
    ops = list(graph.ops)
    ops[i] = op
    return KernelGraph(tuple(ops), graph.outputs).validate()


def _with_block(graph: KernelGraph, i: int, block: BlockGraph) -> KernelGraph:
    op = graph.ops[i]
    return _with_kernel_op(graph, i, Op(op.kind, op.inputs, op.attrs, block))


def _with_attrs(op: Op, **changes) -> Op:
    a = {**op.a, **changes}
    return Op.make(op.kind, op.inputs, block=op.block, **{k: v for k, v in a.items() if v is not None})


def _op_sites(graph: KernelGraph) -> list[tuple[int, int | None, Op]]:
    """(kernel op index, block op index or None, op) for every non-input operator."""
    out = []
    for i, op in enumerate(graph.ops):
        if op.kind == "input":
            continue
        if op.kind == "customized":
            out.extend((i, j, bop) for j, bop in enumerate(op.block.ops))
        else:
            out.append((i, None, op))
    return out


def _replace_site(graph: KernelGraph, i: int, j: int | None, new: Op) -> KernelGraph:
    if j is None:
        return _with_kernel_op(graph, i, new)
    blk = graph.ops[i].block
    ops = list(blk.ops)
    ops[j] = new
    return _with_block(graph, i, replace(blk, ops=tuple(ops)))


def _mutations_of(op: Op, rng: random.Random) -> list[tuple[str, Op]]:
    k, fn = op.kind, op.attr("fn")
    out: list[tuple[str, Op]] = []
    if k == "unary":
        new = rng.choice([f for f in UNARY_FNS if f != fn])
        sc = op.attr("scalar") if new in ("mul_scalar", "add_scalar") else None
        if new in ("mul_scalar", "add_scalar") and sc is None:
            sc = rng.choice((2.0, 0.5, -1.0))
        out.append((f"unary {fn}->{new}", Op.make("unary", op.inputs, fn=new, scalar=sc)))
        if op.attr("scalar") is not None:
            s = op.attr("scalar")
            out.append((f"scalar {s}->{s * 1.5 + 0.25}", _with_attrs(op, scalar=s * 1.5 + 0.25)))
    if k == "binary":
        new = rng.choice([f for f in BINARY_FNS if f != fn])
        out.append((f"binary {fn}->{new}", _with_attrs(op, fn=new)))
        out.append(("swap operands", Op.make(k, op.inputs[::-1], **op.a)))
    if k == "matmul":
        out.append(("flip trans_b", _with_attrs(op, trans_b=None if op.attr("trans_b") else True)))
        out.append(("swap matmul operands", Op.make(k, op.inputs[::-1], **op.a)))
    if k == "reduce":
        out.append((f"reduce {fn}->{'max' if fn == 'sum' else 'sum'}", _with_attrs(op, fn="max" if fn == "sum" else "sum")))
        out.append(("reduce another dim", _with_attrs(op, dim=op.attr("dim", -1) - 1)))
    if k == "rms_norm":
        out.append(("eps changed", _with_attrs(op, eps=float(op.attr("eps", 0.0)) * 10 + 1e-3)))
        if len(op.inputs) == 2:
            out.append(("rms_norm weight dropped", Op.make(k, op.inputs[:1], **op.a)))
    if k == "accum":
        same = {"sum_last": ("mean_sq_last", "rms_last", "max_last"), "mean_sq_last": ("sum_last", "rms_last"),
                "rms_last": ("mean_sq_last", "sum_last"), "max_last": ("sum_last",), "sum": ("sum_last",)}
        if fn in same:
            new = rng.choice(same[fn])
            out.append((f"accum {fn}->{new}", _with_attrs(op, fn=new)))
        if fn in ("rescaled_sum", "rescaled_sum_last"):
            out.append((f"accum {fn} without rescaling", Op.make("accum", op.inputs[:1], fn=fn.replace("rescaled_", ""))))
    if k == "concat":
        out.append(("concat order", Op.make(k, op.inputs[::-1], **op.a)))
    return out


def mutate(graph: KernelGraph, rng: random.Random, tries: int = 30) -> tuple[KernelGraph, str] | None:
    """One random valid mutation of ``graph`` and its description (None if none was found)."""
    for _ in range(tries):
        r = rng.random()
        try:
            if r < 0.55:
                sites = _op_sites(graph)
                if not sites:
                    continue
                i, j, op = rng.choice(sites)
                muts = _mutations_of(op, rng)
                if not muts:
                    continue
                what, new = rng.choice(muts)
                return _replace_site(graph, i, j, new), what + (f" (block op {j})" if j is not None else f" (kernel op {i})")
            if r < 0.75:
                res = _rewire(graph, rng)
            else:
                res = _remap(graph, rng)
            if res is not None:
                return res
        except MuGraphError:
            continue
    return None


def _rewire(graph: KernelGraph, rng: random.Random) -> tuple[KernelGraph, str] | None:
    """An operand replaced by another tensor of the same shape (and phase), or an operator bypassed."""
    sites = _op_sites(graph)
    if not sites:
        return None
    i, j, op = rng.choice(sites)
    if not op.inputs:
        return None
    pos = rng.randrange(len(op.inputs))
    if j is None:
        info = graph.info
        first = graph.tensor_producers.index((i, 0))
        want = info[op.inputs[pos]]
        cands = [t for t in range(first) if t != op.inputs[pos] and info[t].shape == want.shape]
    else:
        blk = graph.ops[i].block
        tiles = block_tile_infos(blk, [graph.info[t] for t in graph.ops[i].inputs])
        n_in = len(blk.inputs)
        want = tiles[op.inputs[pos]]
        cands = [t for t in range(n_in + j) if t != op.inputs[pos] and tiles[t].shape == want.shape]
    if not cands:
        return None
    ins = list(op.inputs)
    ins[pos] = rng.choice(cands)
    new = Op.make(op.kind, tuple(ins), block=op.block, **op.a)
    where = f"block op {j}" if j is not None else f"kernel op {i}"
    return _replace_site(graph, i, j, new), f"operand {pos} of {where} rewired"


def _remap(graph: KernelGraph, rng: random.Random) -> tuple[KernelGraph, str] | None:
    """A changed input map, for-loop dim or output map of a customized operator."""
    cust = [i for i, op in enumerate(graph.ops) if op.kind == "customized"]
    if not cust:
        return None
    i = rng.choice(cust)
    blk = graph.ops[i].block
    r = rng.random()
    if r < 0.6 and blk.inputs:
        k = rng.randrange(len(blk.inputs))
        bi = blk.inputs[k]
        rank = len(graph.info[graph.ops[i].inputs[bi.source]].shape)
        if rng.random() < 0.5:
            fd = rng.choice([d for d in range(-1, rank) if d != bi.forloop_dim])
            nb, what = BlockInput(bi.source, bi.input_map, fd), f"block input {k} forloop_dim {bi.forloop_dim}->{fd}"
        else:
            g = rng.randrange(len(blk.grid))
            d = rng.choice([d for d in range(-1, rank) if d != bi.input_map[g]])
            im = list(bi.input_map)
            im[g] = d
            nb, what = BlockInput(bi.source, tuple(im), bi.forloop_dim), f"block input {k} input_map[{g}] -> {d}"
        ins = list(blk.inputs)
        ins[k] = nb
        return _with_block(graph, i, replace(blk, inputs=tuple(ins))), what
    k = rng.randrange(len(blk.outputs))
    bo = blk.outputs[k]
    g = rng.randrange(len(blk.grid))
    om = list(bo.output_map)
    om[g] = rng.choice([d for d in range(-1, 3) if d != om[g]])
    outs = list(blk.outputs)
    outs[k] = BlockOutput(bo.tensor, tuple(om))
    return _with_block(graph, i, replace(blk, outputs=tuple(outs))), f"block output {k} output_map[{g}] -> {om[g]}"
