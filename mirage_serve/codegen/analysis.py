"""Dimension analyses that code generation needs, over kernel and block graphs.

Two questions are answered with one union-find over "dim nodes" (a tensor and
one of its dims of size > 1; size-1 dims broadcast and join nothing):

* **Block dim classes**: which tile dims of a block graph are positionally the
  same axis (joined by element-wise broadcasting, matmul row/column/inner dims,
  reductions' untouched dims, accumulators). Each class gets one padded
  register extent (a power of two; at least 16 where it feeds ``tl.dot``) and
  one validity mask, so every tile of the class lines up in registers.
* **Row dims** of a kernel graph: the class of dim 0 of the first input. When
  no operator reduces, contracts, loops over, concatenates along or splits
  into partials along that class, every output row depends only on the same
  input rows, so a kernel generated for the bucket's row count can run any
  smaller row count by masking (see :class:`RowInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirage_serve.mugraph.graph import BlockGraph, KernelGraph, Op
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos

Node = tuple  # ("k", tensor, dim) or ("b", kernel_op_index, tile, dim)


class _Union:
    """Union-find over hashable nodes."""

    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}

    def find(self, x: Node) -> Node:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Node, b: Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # deterministic representative: the smaller node
            if rb < ra:
                ra, rb = rb, ra
            self.parent[rb] = ra


@dataclass
class _Graph:
    """Nodes, joins and the nodes reduced over ("contracted"), with why."""

    uf: _Union = field(default_factory=_Union)
    sizes: dict[Node, int] = field(default_factory=dict)
    contracted: dict[Node, str] = field(default_factory=dict)

    def node(self, prefix: tuple, shape: tuple[int, ...], d: int) -> Node | None:
        if shape[d] == 1:
            return None
        n = prefix + (d,)
        self.sizes[n] = shape[d]
        self.uf.find(n)
        return n

    def join(self, a: Node | None, b: Node | None) -> None:
        if a is not None and b is not None:
            self.uf.union(a, b)

    def mark(self, n: Node | None, why: str) -> None:
        if n is not None:
            self.contracted.setdefault(n, why)


def _join_right_aligned(g: _Graph, out: tuple, out_shape, inp: tuple, in_shape) -> None:
    off = len(out_shape) - len(in_shape)
    for d in range(max(0, -off), len(in_shape)):  # extra leading dims of the input (size 1) join nothing
        if in_shape[d] == out_shape[d + off]:
            g.join(g.node(out, out_shape, d + off), g.node(inp, in_shape, d))


def _tile_op_dims(g: _Graph, op: Op, out: tuple, out_shape, ins: list[tuple], in_shapes: list, where: str) -> None:
    """Joins and contractions of one tile/kernel operator (not accum/input/customized)."""
    k = op.kind
    if k in ("unary", "binary"):
        for p, s in zip(ins, in_shapes, strict=True):
            _join_right_aligned(g, out, out_shape, p, s)
    elif k == "matmul":
        (pa, sa), (pb, sb) = (ins[0], in_shapes[0]), (ins[1], in_shapes[1])
        ra, rb, ro = len(sa), len(sb), len(out_shape)
        kb, nb = (rb - 1, rb - 2) if op.attr("trans_b") else (rb - 2, rb - 1)
        for d in range(ra - 2):
            g.join(g.node(out, out_shape, d), g.node(pa, sa, d))
            if rb == ra:
                g.join(g.node(out, out_shape, d), g.node(pb, sb, d))
        g.join(g.node(out, out_shape, ro - 2), g.node(pa, sa, ra - 2))
        g.join(g.node(out, out_shape, ro - 1), g.node(pb, sb, nb))
        g.join(g.node(pa, sa, ra - 1), g.node(pb, sb, kb))
        g.mark(g.node(pa, sa, ra - 1), f"{where} contracts it")
    elif k == "reduce":
        s = in_shapes[0]
        d = op.attr("dim", -1) % len(s)
        keep = op.attr("keepdim", True)
        g.mark(g.node(ins[0], s, d), f"{where} reduces it")
        for e in range(len(s)):
            if e != d:
                g.join(g.node(out, out_shape, e if keep or e < d else e - 1), g.node(ins[0], s, e))
    elif k == "rms_norm":
        s = in_shapes[0]
        for e in range(len(s)):
            g.join(g.node(out, out_shape, e), g.node(ins[0], s, e))
        g.mark(g.node(ins[0], s, len(s) - 1), f"{where} normalises over it")
        if len(ins) > 1:
            _join_right_aligned(g, out, out_shape, ins[1], in_shapes[1])
    elif k == "concat":
        d = op.attr("dim", 0) % len(out_shape)
        for p, s in zip(ins, in_shapes, strict=True):
            for e in range(len(s)):
                if e != d:
                    g.join(g.node(out, out_shape, e), g.node(p, s, e))
            g.mark(g.node(p, s, d), f"{where} concatenates along it")
    elif k == "sum_to":
        s = in_shapes[0]
        for e in range(len(s) - 1):
            g.join(g.node(out, out_shape, e), g.node(ins[0], s, e))
        g.mark(g.node(ins[0], s, len(s) - 1), f"{where} sums it down")


def _accum_dims(g: _Graph, op: Op, out: tuple, out_shape, ins: list[tuple], in_shapes: list, where: str) -> None:
    fn = op.attr("fn")
    s = in_shapes[0]
    last = len(s) - 1
    if fn in ("sum", "rescaled_sum"):
        for e in range(len(s)):
            g.join(g.node(out, out_shape, e), g.node(ins[0], s, e))
    else:
        for e in range(last):
            g.join(g.node(out, out_shape, e), g.node(ins[0], s, e))
        g.mark(g.node(ins[0], s, last), f"{where} accumulates over it")
    if fn.startswith("rescaled"):
        _join_right_aligned(g, out, out_shape, ins[1], in_shapes[1])


def _block_dims(g: _Graph, prefix: tuple, block: BlockGraph, tiles: list[TensorInfo], where: str) -> None:
    n_in = len(block.inputs)
    for j, op in enumerate(block.ops):
        tid = n_in + j
        w = f"{where}, block op {j} ({op.describe()})"
        ins = [prefix + (t,) for t in op.inputs]
        shapes = [tiles[t].shape for t in op.inputs]
        if op.kind == "accum":
            _accum_dims(g, op, prefix + (tid,), tiles[tid].shape, ins, shapes, w)
        else:
            _tile_op_dims(g, op, prefix + (tid,), tiles[tid].shape, ins, shapes, w)


@dataclass(frozen=True)
class BlockDims:
    """Dim classes of one block graph's tiles.

    ``cls[t][d]`` is the class id of tile ``t``'s dim ``d`` (None for size-1 dims);
    ``size[c]`` the extent of class ``c``; classes are numbered 0.. in order of
    first appearance (tile order, then dim order), so numbering is deterministic."""

    tiles: tuple[TensorInfo, ...]
    cls: tuple[tuple[int | None, ...], ...]
    size: tuple[int, ...]


def summed_matmuls(block: BlockGraph) -> dict[int, int]:
    """Sum accumulators (plain or rescaled) -> the tile matmul each one sums, where that matmul is not a
    block output and has no other reader: where the MMA can accumulate in place (``dot_acc``)."""
    n_in = len(block.inputs)
    readers: dict[int, list[int]] = {}
    for j, op in enumerate(block.ops):
        for x in op.inputs:
            readers.setdefault(x, []).append(n_in + j)
    outputs = {bo.tensor for bo in block.outputs}
    out: dict[int, int] = {}
    for j, op in enumerate(block.ops):
        u = n_in + j
        if op.kind != "accum" or op.attr("fn") not in ("sum", "rescaled_sum"):
            continue
        t = op.inputs[0]
        if t >= n_in and block.ops[t - n_in].kind == "matmul" and readers.get(t) == [u] and t not in outputs:
            out[u] = t
    return out


def block_dims(block: BlockGraph, arg_infos: list[TensorInfo]) -> BlockDims:
    """Classes of tile dims of ``block`` read from kernel tensors ``arg_infos``."""
    tiles = block_tile_infos(block, arg_infos)
    g = _Graph()
    _block_dims(g, ("b",), block, tiles, "block")
    ids: dict[Node, int] = {}
    sizes: list[int] = []
    cls = []
    for t, info in enumerate(tiles):
        row = []
        for d in range(len(info.shape)):
            n = g.node(("b", t), info.shape, d)
            if n is None:
                row.append(None)
                continue
            r = g.uf.find(n)
            if r not in ids:
                ids[r] = len(sizes)
                sizes.append(info.shape[d])
            row.append(ids[r])
        cls.append(tuple(row))
    return BlockDims(tuple(tiles), tuple(cls), tuple(sizes))


@dataclass(frozen=True)
class RowInfo:
    """Which dims of which kernel tensors are row (batch) dims.

    ``dims[t]`` is the row dim of kernel tensor ``t`` or None. ``variable`` is
    True when the graph may run with fewer rows than ``bucket``: then the row dim
    of every input is its dim 0 and those inputs are ``row_inputs`` (positions in
    the graph's input order). Otherwise ``reason`` says why the row count is fixed.
    """

    bucket: int
    variable: bool
    dims: tuple[int | None, ...]
    row_inputs: tuple[int, ...]
    reason: str = ""


def _kernel_dims(graph: KernelGraph) -> _Graph:
    """Dim classes of every kernel tensor and tile of ``graph``, with the contracted ones marked."""
    info = graph.info
    g = _Graph()
    for i, op in enumerate(graph.ops):
        start = graph.tensor_producers.index((i, 0))
        where = f"kernel op {i} ({op.describe()})"
        ins = [("k", t) for t in op.inputs]
        shapes = [info[t].shape for t in op.inputs]
        if op.kind == "input":
            continue
        if op.kind != "customized":
            _tile_op_dims(g, op, ("k", start), info[start].shape, ins, shapes, where)
            continue
        block = op.block
        tiles = block_tile_infos(block, [info[t] for t in op.inputs])
        prefix = ("b", i)
        for j, bi in enumerate(block.inputs):
            src, ts = op.inputs[bi.source], tiles[j].shape
            for d in range(len(ts)):
                g.join(g.node(prefix + (j,), ts, d), g.node(("k", src), info[src].shape, d))
                # a dim whose tile is smaller than the tensor is split; keep the tensor node
                g.node(("k", src), info[src].shape, d)
            if bi.forloop_dim >= 0:
                g.mark(g.node(("k", src), info[src].shape, bi.forloop_dim), f"{where}, block input {j} loops over it")
        _block_dims(g, prefix, block, tiles, where)
        # tensor dims split by the same grid dim into equal tiles are aligned by the block index
        for j, bi in enumerate(block.inputs):
            src = op.inputs[bi.source]
            for gd, d in enumerate(bi.input_map):
                if d >= 0 and block.grid[gd] > 1 and d != bi.forloop_dim:
                    g.join(("g", i, gd, tiles[j].shape[d]), g.node(("k", src), info[src].shape, d))
        for j, bo in enumerate(block.outputs):
            ts = tiles[bo.tensor].shape
            n_partial = len(info[start + j].shape) - len(ts)
            for gd, d in enumerate(bo.output_map):
                if d >= 0 and block.grid[gd] > 1:
                    g.join(("g", i, gd, ts[d]), g.node(("k", start + j), info[start + j].shape, n_partial + d))
        for j, bo in enumerate(block.outputs):
            out_t = start + j
            ts = tiles[bo.tensor].shape
            n_partial = len(info[out_t].shape) - len(ts)
            for d in range(len(ts)):
                g.join(g.node(prefix + (bo.tensor,), ts, d), g.node(("k", out_t), info[out_t].shape, n_partial + d))
            for gd, size in enumerate(block.grid):
                if size > 1 and bo.output_map[gd] == -1:
                    for jj, bi in enumerate(block.inputs):
                        d = bi.input_map[gd] if gd < len(bi.input_map) else -1
                        if d >= 0:
                            src = op.inputs[bi.source]
                            g.mark(g.node(("k", src), info[src].shape, d), f"{where}, output {j} is partial over grid dim {gd}, which splits block input {jj} along it")
    return g


def row_info(graph: KernelGraph) -> RowInfo:
    """Infer row dims: the dims that propagate from dim 0 of the first input."""
    info = graph.info
    g = _kernel_dims(graph)
    first = graph.input_ids[0]
    bucket = info[first].shape[0]
    dims: list[int | None] = [None] * len(info)
    if bucket == 1:
        return RowInfo(1, False, tuple(dims), (), "the bucket has one row")
    root = g.uf.find(("k", first, 0))
    members = [n for n in g.sizes if g.uf.find(n) == root]
    reasons = sorted(g.contracted[n] for n in members if n in g.contracted)
    for n in members:
        if n[0] == "k":
            dims[n[1]] = n[2]
    if reasons:
        return RowInfo(bucket, False, tuple(dims), (), f"rows are not independent: {reasons[0]}")
    for t in range(len(info)):
        in_rows = sorted(n[2] for n in members if n[0] == "k" and n[1] == t)
        if len(in_rows) > 1:
            return RowInfo(bucket, False, tuple(dims), (), f"tensor {t} has the rows in dims {in_rows} (e.g. X @ X^T)")
    moved = _grid_moves_rows(graph, dims)
    if moved:
        return RowInfo(bucket, False, tuple(dims), (), moved)
    row_inputs = []
    for pos, t in enumerate(graph.input_ids):
        if dims[t] is not None and dims[t] != 0:
            return RowInfo(bucket, False, tuple(dims), (), f"input {pos} has its row dim at position {dims[t]}, not 0")
        if dims[t] == 0:
            row_inputs.append(pos)
    for t, d in enumerate(dims):
        if d is not None and info[t].shape[d] != bucket:  # pragma: no cover - sizes of one class agree
            return RowInfo(bucket, False, tuple(dims), (), f"tensor {t} dim {d} joins the rows with size {info[t].shape[d]}")
    return RowInfo(bucket, True, tuple(dims), tuple(row_inputs))


def _grid_moves_rows(graph: KernelGraph, dims: list[int | None]) -> str | None:
    """Why a grid dim that splits the rows of a block input does not place them in an output's
    row dim (it maps them onto another dim), or None."""
    producers = graph.tensor_producers
    for i, op in enumerate(graph.ops):
        if op.kind != "customized":
            continue
        start = producers.index((i, 0))
        block = op.block
        tiles = block_tile_infos(block, [graph.info[t] for t in op.inputs])
        for j, bi in enumerate(block.inputs):
            src = op.inputs[bi.source]
            for gd, d in enumerate(bi.input_map):
                if d < 0 or block.grid[gd] == 1 or d != dims[src]:
                    continue
                for k, bo in enumerate(block.outputs):
                    od = bo.output_map[gd]
                    n_partial = len(graph.info[start + k].shape) - len(tiles[bo.tensor].shape)
                    if od >= 0 and dims[start + k] != n_partial + od:
                        return (f"kernel op {i} ({op.describe()}): grid dim {gd} splits the rows of block input {j} "
                                f"but places output {k}'s tiles along dim {n_partial + od}, not its row dim")
    return None


@dataclass(frozen=True)
class ExtentInfo:
    """Variable extents of a kernel graph (see :func:`extent_info`).

    ``dims[t]`` maps each variable dim of kernel tensor ``t`` to its extent id;
    ``bucket[e]`` is extent ``e``'s size in the graph (the most it may be at run time)."""

    dims: tuple[dict[int, int], ...]
    bucket: tuple[int, ...]


def extent_info(graph: KernelGraph, seeds: tuple[tuple[int, int], ...], rows: RowInfo | None = None) -> ExtentInfo:
    """Classes of the (input position, dim) ``seeds``: each class becomes one variable extent.

    Every kernel tensor dim in a seed's class is variable. Raises CodegenError when a
    class is the row class, or reaches a pre-defined kernel operator (those run as
    torch ops on whole tensors and would read the invalid positions)."""
    from mirage_serve.codegen.params import CodegenError

    info = graph.info
    g = _kernel_dims(graph)
    roots: list[Node] = []
    for pos, d in seeds:
        if not 0 <= pos < len(graph.input_ids):
            raise CodegenError(f"variable dim seed {(pos, d)}: the graph has {len(graph.input_ids)} inputs")
        t = graph.input_ids[pos]
        if not 0 <= d < len(info[t].shape) or info[t].shape[d] == 1:
            raise CodegenError(f"variable dim seed {(pos, d)}: input {pos} has shape {list(info[t].shape)}; name a dim of size > 1")
        r = g.uf.find(("k", t, d))
        if r not in roots:
            roots.append(r)
    if rows is not None and rows.bucket > 1:
        first = graph.input_ids[0]
        if g.uf.find(("k", first, 0)) in roots:
            raise CodegenError("a variable extent joins the row (batch) dims; rows are already variable")
    dims: list[dict[int, int]] = [{} for _ in info]
    bucket: list[int] = [0] * len(roots)
    producers = graph.tensor_producers
    for n, size in g.sizes.items():
        if n[0] != "k":
            continue
        r = g.uf.find(n)
        if r in roots:
            e = roots.index(r)
            t, d = n[1], n[2]
            op = graph.ops[producers[t][0]]
            if op.kind not in ("input", "customized"):
                raise CodegenError(f"variable extent {e} reaches kernel operator {op.describe()}, which runs as a torch op; not supported")
            if bucket[e] not in (0, size):
                raise CodegenError(f"variable extent {e} has sizes {bucket[e]} and {size} in different tensors; not supported")
            bucket[e] = size
            dims[t][d] = e
    for op in graph.ops:
        if op.kind not in ("input", "customized") and any(dims[t] for t in op.inputs):
            raise CodegenError(f"variable extent reaches kernel operator {op.describe()}, which runs as a torch op; not supported")
    return ExtentInfo(tuple(dims), tuple(bucket))
