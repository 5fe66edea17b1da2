"""Index labels: which axis of the spec each tensor dim stands for.

Abstract expressions (:mod:`mirage_serve.search.abstract`) are dimension-free:
``Sum(n, x)`` does not say *which* axis it sums, so a sum over the batch axis
looks as possible as the sum over the hidden axis the spec really performs.
Index labels add that missing information as a structural rule, in the style
of einsum subscripts:

* Every dim of every tensor of the spec gets a label; dims that the spec's
  operators line up (the two sides of a contraction, broadcast partners, an
  operator's input and output along the same axis) get the same label (a
  union-find over ``(tensor, dim)``).
* The *contracted* labels are those the spec reduces: matmul inner dims,
  ``reduce`` dims, the normalised dim of an RMSNorm.
* A candidate's tensors and tiles carry the labels of the kernel inputs they
  derive from. An operator is rejected when it

  - reduces or contracts (``reduce``, matmul inner dim, a row accumulator,
    ``sum_to``, ``rms_norm``) a label the spec never reduces,
  - lines up two different labels (matmul inner dims, broadcast partners,
    the non-concatenated dims of a concat),
  - concatenates along a label the spec does not contract, or along a
    concatenated one (a concat is only useful as one side of a split
    contraction: ``(X | X@A) @ (W ; B)``),
  - produces a tensor with the same label on two dims (``X @ X^T``).

``None`` is the wildcard: a kept dim a reduction collapsed, or a tensor whose
origin is not tracked; it lines up with any label. A labelled dim lines up only
with the same label, whatever its extent: an axis that has extent one at the
spec's sizes (the query group of multi-head attention, the batch at batch 1)
does not broadcast against another axis, so the operators the rule admits do
not depend on which axes happen to be one long. (Were they admitted, multi-head
attention's Q tile would multiply K and V tiles elementwise, and the search
would spend its budget on those products before reaching Q·Kᵀ.)
The rule assumes that every intermediate of a useful program is indexed by
the spec's own axes, which holds for the fusions of the paper: tiling,
split reductions, running maxima and concatenated contractions never need an
axis the spec does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError, Op

Label = object  # a str, a ("cat", labels) tuple, or None (wildcard)


@dataclass(frozen=True)
class SpecLabels:
    """The labels of the spec's inputs and outputs, and the contracted labels."""

    inputs: tuple[tuple[Label, ...], ...]  # per kernel input, per dim
    outputs: tuple[tuple[Label, ...], ...]
    contracted: frozenset
    var_labels: tuple[tuple[str, tuple[Label, ...]], ...] = ()  # kernel input name -> its labels
    summands: tuple[tuple[Label, frozenset], ...] = ()  # label -> summand signatures of the spec's sums over it

    def summand_ok(self, op: Op, in_exprs: list, in_labels: list[tuple[Label, ...]], in_shapes: list[tuple[int, ...]]) -> bool:
        """A sum over label ``l`` must sum the same product of ``l``-carrying inputs
        as one of the spec's sums over ``l`` (see :func:`summand_signature`)."""
        from mirage_serve.search.abstract import Expr, Mul, Square

        if not self.summands or not all(isinstance(e, Expr) for e in in_exprs):
            return True  # no expressions (pruning off, or another abstraction)

        kind, fn = op.kind, op.attr("fn")
        if kind == "matmul":
            trans = bool(op.attr("trans_b"))
            b = in_shapes[1]
            kb = len(b) - 1 if trans else len(b) - 2
            label = in_labels[0][-1] if in_labels[0][-1] is not None else in_labels[1][kb]
            summand = Mul(in_exprs[0], in_exprs[1])
        elif kind == "reduce" and fn == "sum":
            label = in_labels[0][op.attr("dim", -1) % len(in_labels[0])]
            summand = in_exprs[0]
        elif kind == "accum" and fn in ("sum_last", "rescaled_sum_last", "sum_to"):
            label, summand = in_labels[0][-1], in_exprs[0]
        elif kind == "sum_to":
            label, summand = in_labels[0][-1], in_exprs[0]
        elif (kind == "accum" and fn in ("mean_sq_last", "rms_last")) or kind == "rms_norm":
            label, summand = in_labels[0][-1], Square(in_exprs[0])
        else:
            return True
        allowed = dict(self.summands).get(label)
        if allowed is None:
            return True
        return summand_signature(summand, self.carriers(label)) in allowed

    def carriers(self, label: Label) -> frozenset[str]:
        return frozenset(name for name, labs in self.var_labels if label in labs)

    def in_outputs(self, label: Label) -> bool:
        """Does ``label`` index a dim of one of the spec's outputs (``None``: it may)?"""
        return label is None or any(label in out for out in self.outputs)

    def is_contracted(self, label: Label) -> bool:
        if label is None or label in self.contracted:
            return True
        return isinstance(label, tuple) and label[0] == "cat" and all(self.is_contracted(p) for p in label[1])


def summand_signature(expr, carriers: frozenset[str]) -> frozenset:
    """Per monomial of ``expr``'s normal form, the kernel inputs among ``carriers``
    (those indexed by the summed label) with their exponents. Reductions and
    function atoms (``exp``, ``sqrt``, ``max``, ...) are left out: the signature
    records which inputs are multiplied together under the sum, the part of
    axiom 5 (``Sum(n, x*y) = Sum(n, x)*y``) that only holds when ``y`` does not
    carry the summed label."""
    from mirage_serve.search.abstract import normal_form

    sig = set()
    for mono, _ in normal_form(expr):
        sig.add(tuple(sorted((atom[1], e) for atom, e in mono if atom[0] == "var" and atom[1] in carriers)))
    return frozenset(sig)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _align(a: tuple[int, ...], b: tuple[int, ...]):
    """Right-aligned dim pairs (i in a or None, j in b or None) of a broadcast."""
    n = max(len(a), len(b))
    for k in range(n):
        i = len(a) - n + k
        j = len(b) - n + k
        yield (i if i >= 0 else None), (j if j >= 0 else None)


def spec_labels(spec: KernelGraph) -> SpecLabels:
    """Label every dim of the spec's tensors (see the module docstring)."""
    info = spec.info
    uf = _UnionFind()
    contracted_nodes = []
    t = 0
    inputs = []
    for op in spec.ops:
        ins = list(op.inputs)
        outs = list(range(t, t + op.num_outputs))
        t += op.num_outputs
        if op.kind == "input":
            for o in outs:
                inputs.append(o)
                for d in range(len(info[o].shape)):
                    uf.find((o, d))
            continue
        out = outs[0]
        oshape = info[out].shape
        if op.kind in ("unary",):
            for d in range(len(oshape)):
                uf.union((out, d), (ins[0], d))
        elif op.kind == "binary" or (op.kind == "rms_norm" and len(ins) == 2):
            a, b = info[ins[0]].shape, info[ins[1]].shape
            for (i, j), d in zip(_align(a, b), range(len(oshape)), strict=True):
                if i is not None and a[i] == oshape[d]:
                    uf.union((out, d), (ins[0], i))
                if j is not None and b[j] == oshape[d]:
                    uf.union((out, d), (ins[1], j))
            if op.kind == "rms_norm":
                contracted_nodes.append((ins[0], len(a) - 1))
        elif op.kind == "rms_norm":
            for d in range(len(oshape)):
                uf.union((out, d), (ins[0], d))
            contracted_nodes.append((ins[0], len(oshape) - 1))
        elif op.kind == "matmul":
            a, b = info[ins[0]].shape, info[ins[1]].shape
            trans = bool(op.attr("trans_b"))
            kb = len(b) - 1 if trans else len(b) - 2
            nb = len(b) - 2 if trans else len(b) - 1
            uf.union((ins[0], len(a) - 1), (ins[1], kb))
            contracted_nodes.append((ins[0], len(a) - 1))
            r = len(oshape)
            uf.union((out, r - 2), (ins[0], len(a) - 2))
            uf.union((out, r - 1), (ins[1], nb))
            for (i, j), d in zip(_align(a[:-2], b[:-2]), range(r - 2), strict=True):
                if i is not None and a[i] == oshape[d]:
                    uf.union((out, d), (ins[0], i))
                if j is not None and b[j] == oshape[d] and oshape[d] > 1:
                    uf.union((out, d), (ins[1], j))
        elif op.kind == "reduce":
            shape = info[ins[0]].shape
            d0 = op.attr("dim", -1) % len(shape)
            keep = op.attr("keepdim", True)
            contracted_nodes.append((ins[0], d0))
            k = 0
            for d in range(len(shape)):
                if d == d0:
                    if keep:
                        k += 1
                    continue
                uf.union((out, k), (ins[0], d))
                k += 1
        elif op.kind == "concat":
            d0 = op.attr("dim", 0) % len(oshape)
            for s in ins:
                for d in range(len(oshape)):
                    if d != d0:
                        uf.union((out, d), (s, d))
        else:
            raise MuGraphError(f"index labels: no rule for spec operator {op.kind!r}")
    contracted = frozenset(uf.find(n) for n in contracted_nodes)

    def lab(tensor: int) -> tuple[Label, ...]:
        return tuple(f"a{uf.find((tensor, d))[0]}.{uf.find((tensor, d))[1]}" for d in range(len(info[tensor].shape)))

    contracted_names = frozenset(f"a{n[0]}.{n[1]}" for n in contracted)
    names = tuple((spec.ops[i].attr("name"), lab(t)) for i, t in zip(
        [k for k, op in enumerate(spec.ops) if op.kind == "input"], inputs, strict=True))
    base = SpecLabels(tuple(lab(i) for i in inputs), tuple(lab(o) for o in spec.outputs), contracted_names, names)
    # the summands of the spec's sums, per summed label
    from mirage_serve.search.abstract import Mul, Square, graph_exprs

    exprs = graph_exprs(spec)
    sums: dict = {}
    for op in spec.ops:
        ins = list(op.inputs)
        if op.kind == "matmul":
            label, summand = lab(ins[0])[-1], Mul(exprs[ins[0]], exprs[ins[1]])
        elif op.kind == "reduce" and op.attr("fn") == "sum":
            label, summand = lab(ins[0])[op.attr("dim", -1) % len(info[ins[0]].shape)], exprs[ins[0]]
        elif op.kind == "rms_norm":
            label, summand = lab(ins[0])[-1], Square(exprs[ins[0]])
        else:
            continue
        sums.setdefault(label, set()).add(summand_signature(summand, base.carriers(label)))
    return SpecLabels(base.inputs, base.outputs, base.contracted, base.var_labels,
                      tuple((k, frozenset(v)) for k, v in sorted(sums.items())))


def _merge(la: Label, lb: Label) -> tuple[bool, Label]:
    """Line up two dims labelled la, lb, whatever their extents: (ok, label of the result)."""
    if la is None:
        return True, lb
    if lb is None or la == lb:
        return True, la
    return False, None


def _broadcast(a_shape, a_lab, b_shape, b_lab) -> tuple[Label, ...] | None:
    out = []
    for i, j in _align(a_shape, b_shape):
        if i is None:
            out.append(b_lab[j])
        elif j is None:
            out.append(a_lab[i])
        else:
            ok, lab = _merge(a_lab[i], b_lab[j])
            if not ok:
                return None
            out.append(lab)
    return tuple(out)


def _distinct(labels: tuple[Label, ...]) -> bool:
    named = [x for x in labels if x is not None]
    return len(named) == len(set(named))


def op_labels(op: Op, in_shapes: list[tuple[int, ...]], in_labels: list[tuple[Label, ...]],
              out_shape: tuple[int, ...], spec: SpecLabels) -> tuple[Label, ...] | None:
    """Labels of a tile or kernel operator's output, or None if the operator
    breaks a label rule. Accumulators use their own row reductions (``fn``)."""
    kind = op.kind
    fn = op.attr("fn")
    if kind == "unary" or (kind == "accum" and fn in ("sum", "rescaled_sum")):
        out = in_labels[0]
    elif kind == "accum" or kind == "sum_to":
        lab = in_labels[0]
        if not spec.is_contracted(lab[-1]):
            return None
        out = lab[:-1] + (lab[-1] if kind == "sum_to" else None,)
    elif kind == "binary":
        out = _broadcast(in_shapes[0], in_labels[0], in_shapes[1], in_labels[1])
    elif kind == "rms_norm":
        if not spec.is_contracted(in_labels[0][-1]):
            return None
        out = in_labels[0]
        if len(in_labels) == 2 and _broadcast(in_shapes[0], in_labels[0], in_shapes[1], in_labels[1]) is None:
            return None
    elif kind == "matmul":
        a, b = in_shapes
        la, lb = in_labels
        trans = bool(op.attr("trans_b"))
        kb = len(b) - 1 if trans else len(b) - 2
        nb = len(b) - 2 if trans else len(b) - 1
        ok, k = _merge(la[-1], lb[kb])
        if not ok or not spec.is_contracted(k):
            return None
        batch = _broadcast(a[:-2], la[:-2], b[:-2], lb[:-2])
        if batch is None:
            return None
        out = batch + (la[-2], lb[nb])
    elif kind == "reduce":
        lab = in_labels[0]
        d = op.attr("dim", -1) % len(lab)
        if not spec.is_contracted(lab[d]):
            return None
        out = lab[:d] + ((None,) if op.attr("keepdim", True) else ()) + lab[d + 1 :]
    elif kind == "concat":
        d = op.attr("dim", 0) % len(out_shape)
        first = in_labels[0]
        parts = []
        for lab in in_labels:
            for k in range(len(lab)):
                if k != d and not _merge(first[k], lab[k])[0]:
                    return None
            parts.append(lab[d])
        if any(not spec.is_contracted(p) or isinstance(p, tuple) for p in parts):
            return None  # concat along a kept label, or of a concat: one level of split contraction only
        flat = []
        for p in parts:
            flat.extend(p[1] if isinstance(p, tuple) else (p,))
        cat = ("cat", tuple(flat)) if None not in flat else None
        out = first[:d] + (cat,) + first[d + 1 :]
    else:
        return None
    if out is None or len(out) != len(out_shape) or not _distinct(out):
        return None
    return tuple(out)


def wildcard(rank: int) -> tuple[Label, ...]:
    return (None,) * rank


def kernel_labels(graph: KernelGraph, spec: SpecLabels | None) -> list[tuple[Label, ...]]:
    """Labels of every tensor of a candidate kernel graph whose inputs are the
    spec's inputs (wildcards where a label cannot be followed)."""
    info = graph.info
    out: list[tuple[Label, ...]] = []
    n_in = 0
    for op in graph.ops:
        if op.kind == "input":
            if spec is not None and n_in < len(spec.inputs) and len(spec.inputs[n_in]) == len(info[len(out)].shape):
                out.append(spec.inputs[n_in])
            else:
                out.append(wildcard(len(info[len(out)].shape)))
            n_in += 1
            continue
        if spec is None:
            out.extend(wildcard(len(info[len(out) + k].shape)) for k in range(op.num_outputs))
            continue
        if op.kind == "customized":
            out.extend(block_output_labels(op, [info[t] for t in op.inputs], [out[t] for t in op.inputs], spec))
            continue
        lab = op_labels(op, [info[t].shape for t in op.inputs], [out[t] for t in op.inputs], info[len(out)].shape, spec)
        out.append(lab if lab is not None else wildcard(len(info[len(out)].shape)))
    return out


def block_output_labels(op: Op, arg_infos, arg_labels, spec: SpecLabels) -> list[tuple[Label, ...]]:
    """Labels of a customized operator's output tensors: the stored tiles' labels,
    after one leading dim per grid dim that produced partial results (labelled
    by the dim that grid dim splits)."""
    from mirage_serve.mugraph.shapes import TensorInfo, infer_tile_op, tile_shape_of_input
    from mirage_serve.search.enumerate import accum_info

    block = op.block
    tiles = []
    tshapes = []
    for bi in block.inputs:
        shape = tile_shape_of_input(arg_infos[bi.source].shape, block.grid, bi.input_map, bi.forloop_dim, block.forloop_range, "labels")
        tiles.append(tuple(arg_labels[bi.source]))
        tshapes.append(shape)
    infos = [TensorInfo(s, arg_infos[bi.source].dtype, "loop" if bi.forloop_dim >= 0 else "invariant") for s, bi in zip(tshapes, block.inputs, strict=True)]
    for bop in block.ops:
        ins = [infos[t] for t in bop.inputs]
        try:
            if bop.kind == "accum":
                oinfo = accum_info(bop.attr("fn"), ins, bop.attr("size"))
            else:
                oinfo = infer_tile_op(bop, ins, "labels")
        except MuGraphError:
            oinfo = TensorInfo(ins[0].shape, ins[0].dtype)
        lab = op_labels(bop, [i.shape for i in ins], [tiles[t] for t in bop.inputs], oinfo.shape, spec)
        tiles.append(lab if lab is not None else wildcard(len(oinfo.shape)))
        infos.append(oinfo)
    outs = []
    for bo in block.outputs:
        lead = []
        for g, m in enumerate(bo.output_map):
            if m < 0:
                split = next(((bi.source, bi.input_map[g]) for bi in block.inputs if bi.input_map[g] >= 0), None)
                lead.append(arg_labels[split[0]][split[1]] if split is not None else None)
        outs.append(tuple(lead) + tuple(tiles[bo.tensor]))
    return outs
