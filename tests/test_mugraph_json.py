"""Canonical μGraph JSON: exact round trips, the content hash, and malformed input."""

from __future__ import annotations

import json

import pytest
from handwritten import fused_lora, fused_rmsnorm_linear, split_kv_attention
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mirage_serve.mugraph import (
    BINARY_FNS,
    DTYPES,
    UNARY_FNS,
    BlockBuilder,
    GraphBuilder,
    KernelGraph,
    MuGraphError,
    Op,
    content_hash,
    from_json,
    graph_to_obj,
    to_json,
)
from mirage_serve.mugraph.serialize import MAX_JSON_DEPTH, MAX_OPS
from mirage_serve.mugraph.shapes import TensorInfo, broadcast_shapes, infer_tile_op, tile_shape_of_input

SIZES = st.sampled_from([1, 2, 4, 8])
SCALARS = st.floats(-4, 4, allow_nan=False, width=32)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        broadcast_shapes(a, b, "")
    except MuGraphError:
        return False
    return True


def _fits(m: tuple[int, ...], x: tuple[int, ...]) -> bool:
    """A running max of shape ``m`` broadcasts into the tile ``x`` without enlarging it."""
    out = broadcast_shapes(x, m, "")
    lead = len(out) - len(x)
    return out[lead:] == x and all(d == 1 for d in out[:lead])


def _matmul_ok(a: tuple[int, ...], b: tuple[int, ...], trans_b: bool) -> bool:
    if len(a) < 2 or len(b) < 2 or (len(b) != 2 and a[:-2] != b[:-2]):
        return False
    return a[-1] == (b[-1] if trans_b else b[-2])


def _unary(draw) -> dict:
    fn = draw(st.sampled_from(UNARY_FNS))
    return {"fn": fn, "scalar": draw(SCALARS) if fn in ("mul_scalar", "add_scalar") else None}


def _draw_block(draw, shapes: list[tuple[int, ...]]) -> tuple[list[int], object]:
    """A random valid block graph over some of the kernel tensors ``shapes``; returns
    (kernel tensor ids it reads, block graph)."""
    grid = tuple(draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=3)))
    rng = draw(st.sampled_from([1, 2, 4]))
    sources = draw(st.lists(st.integers(0, len(shapes) - 1), min_size=1, max_size=3))
    b = BlockBuilder(grid, rng)
    tiles: list[tuple[tuple[int, ...], str]] = []  # (shape, phase)
    for j, t in enumerate(sources):
        shape = shapes[t]
        tile, imap = list(shape), []
        for g in grid:
            options = [-1] + [d for d in range(len(shape)) if d not in imap and tile[d] % g == 0]
            d = draw(st.sampled_from(options))
            imap.append(d)
            if d >= 0:
                tile[d] //= g
        fdim = draw(st.sampled_from([-1] + [d for d in range(len(shape)) if tile[d] % rng == 0]))
        b.input(j, imap, fdim)
        tiles.append((tile_shape_of_input(shape, grid, tuple(imap), fdim, rng, "gen"), "loop" if fdim >= 0 else "invariant"))
    rank = {"invariant": 0, "both": 1, "loop": 2, "post": 2}
    max_ids: list[int] = []

    def add(shape, phase, tid):
        assert tid == len(tiles)
        tiles.append((shape, phase))

    def combined(*ids):
        phases = {tiles[i][1] for i in ids}
        if "loop" in phases and "post" in phases:
            return None
        return max(phases, key=rank.__getitem__)

    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["unary", "binary", "matmul", "reduce", "accum", "accum"]))
        n = len(tiles)
        if kind == "unary":
            i = draw(st.integers(0, n - 1))
            add(tiles[i][0], tiles[i][1], b.unary(x=i, **_unary(draw)))
        elif kind == "binary":
            i = draw(st.integers(0, n - 1))
            partners = [k for k in range(n) if _broadcasts(tiles[i][0], tiles[k][0]) and combined(i, k)]
            k = draw(st.sampled_from(partners))
            shape = broadcast_shapes(tiles[i][0], tiles[k][0], "gen")
            if len(shape) <= 4:
                add(shape, combined(i, k), b.binary(draw(st.sampled_from(BINARY_FNS)), i, k))
        elif kind == "matmul":
            trans_b = draw(st.booleans())
            pairs = [(i, k) for i in range(n) for k in range(n) if _matmul_ok(tiles[i][0], tiles[k][0], trans_b) and combined(i, k)]
            if pairs:
                i, k = draw(st.sampled_from(pairs))
                op = Op.make("matmul", (i, k), trans_b=trans_b or None)
                info = infer_tile_op(op, [TensorInfo(tiles[i][0], "float32"), TensorInfo(tiles[k][0], "float32")], "gen")
                add(info.shape, combined(i, k), b.matmul(i, k, trans_b))
        elif kind == "reduce":
            i = draw(st.integers(0, n - 1))
            d = draw(st.integers(0, len(tiles[i][0]) - 1))
            shape = tiles[i][0][:d] + (1,) + tiles[i][0][d + 1 :]
            add(shape, tiles[i][1], b.reduce(draw(st.sampled_from(["sum", "max"])), i, d))
        else:
            open_ids = [i for i in range(n) if tiles[i][1] in ("loop", "invariant")]
            if not open_ids:
                continue
            i = draw(st.sampled_from(open_ids))
            shape = tiles[i][0]
            last = shape[:-1] + (1,)
            fn = draw(st.sampled_from(["sum", "sum_last", "mean_sq_last", "rms_last", "sum_to", "max_last", "rescaled"]))
            if fn == "sum_to":
                size = draw(st.sampled_from([s for s in (1, 2, 4, 8) if shape[-1] % s == 0]))
                add(shape[:-1] + (size,), "post", b.accum("sum_to", i, size=size))
            elif fn == "max_last":
                m = b.accum("max_last", i)
                add(last, "both", m)
                max_ids.append(m)
                if draw(st.booleans()):  # the online-softmax pattern: exp(x - m) rescaled by m
                    p = b.unary("exp", b.binary("sub", i, m))
                    add(shape, "loop" if tiles[i][1] == "loop" else "both", p - 1)
                    add(shape, tiles[p - 1][1], p)
                    which = draw(st.sampled_from(["rescaled_sum", "rescaled_sum_last"]))
                    add(shape if which == "rescaled_sum" else last, "post", b.accum(which, p, m))
            elif fn == "rescaled":
                ms = [m for m in max_ids if _broadcasts(shape, tiles[m][0]) and _fits(tiles[m][0], shape)]
                if ms:
                    m = draw(st.sampled_from(ms))
                    which = draw(st.sampled_from(["rescaled_sum", "rescaled_sum_last"]))
                    add(shape if which == "rescaled_sum" else last, "post", b.accum(which, i, m))
            else:
                add(shape if fn == "sum" else last, "post", b.accum(fn, i))
    done = [i for i in range(len(tiles)) if tiles[i][1] != "loop"]
    if not done:
        add(tiles[0][0], "post", b.accum("sum", 0))
        done = [len(tiles) - 1]
    for t in draw(st.lists(st.sampled_from(done), min_size=1, max_size=2)):
        tile, omap = tiles[t][0], []
        partial = 0
        for g in grid:
            options = [d for d in range(len(tile)) if d not in omap]
            if g == 1 or len(tile) + partial < 4:
                options.append(-1)
            if not options:
                options = [-1]
            d = draw(st.sampled_from(options))
            partial += d == -1 and g > 1
            omap.append(d)
        if len(tile) + partial > 4:
            continue
        b.output(t, omap)
    if not b.outputs:  # greedy: tile a free dim with every grid dim of size > 1
        tile, omap = tiles[done[0]][0], []
        for g in grid:
            free = [d for d in range(len(tile)) if d not in omap]
            omap.append(free[0] if g > 1 and free else -1)
        assume(len(tile) + sum(d == -1 and g > 1 for d, g in zip(omap, grid)) <= 4)
        b.output(done[0], omap)
    return sources, b.build()


@st.composite
def kernel_graphs(draw) -> KernelGraph:
    """Random valid kernel graphs: inputs, pre-defined operators and customized operators."""
    dtype = draw(st.sampled_from(DTYPES))
    g = GraphBuilder()
    for i in range(draw(st.integers(1, 3))):
        g.input(f"in{i}", draw(st.lists(SIZES, min_size=1, max_size=3)), dtype)
    for _ in range(draw(st.integers(1, 4))):
        shapes = [t.shape for t in KernelGraph(tuple(g.ops), (0,)).info]
        n = len(shapes)
        kind = draw(st.sampled_from(["unary", "binary", "reduce", "matmul", "rms_norm", "concat", "customized", "customized"]))
        if kind == "unary":
            g.unary(x=draw(st.integers(0, n - 1)), **_unary(draw))
        elif kind == "binary":
            i = draw(st.integers(0, n - 1))
            k = draw(st.sampled_from([k for k in range(n) if _broadcasts(shapes[i], shapes[k])]))
            g.binary(draw(st.sampled_from(BINARY_FNS)), i, k)
        elif kind == "reduce":
            i = draw(st.integers(0, n - 1))
            keepdim = len(shapes[i]) == 1 or draw(st.booleans())
            g.reduce(draw(st.sampled_from(["sum", "max"])), i, draw(st.integers(-len(shapes[i]), len(shapes[i]) - 1)), keepdim)
        elif kind == "matmul":
            trans_b = draw(st.booleans())
            pairs = [(i, k) for i in range(n) for k in range(n) if _matmul_ok(shapes[i], shapes[k], trans_b)]
            if pairs:
                i, k = draw(st.sampled_from(pairs))
                g.matmul(i, k, trans_b)
        elif kind == "rms_norm":
            i = draw(st.integers(0, n - 1))
            weights = [k for k in range(n) if shapes[k] == (shapes[i][-1],)]
            w = draw(st.sampled_from([None] + weights))
            g.rms_norm(i, w, eps=draw(st.sampled_from([0.0, 1e-6, 1e-5])))
        elif kind == "concat":
            i = draw(st.integers(0, n - 1))
            same = [k for k in range(n) if shapes[k] == shapes[i]]
            xs = draw(st.lists(st.sampled_from(same), min_size=1, max_size=3))
            g.concat(xs, draw(st.integers(0, len(shapes[i]) - 1)))
        else:
            sources, block = _draw_block(draw, [shapes[t] for t in range(n)])
            g.customized(sources, block)
    n = KernelGraph(tuple(g.ops), (0,)).num_tensors
    extra = draw(st.lists(st.integers(0, n - 1), max_size=2))
    return g.build([n - 1, *extra])


def _reordered(graph: KernelGraph, order: list[int]) -> KernelGraph:
    """The same graph with its operators in ``order`` (a topological order), renumbered."""
    producers = graph.tensor_producers
    first = {}
    for t, (i, _j) in enumerate(producers):
        first.setdefault(i, t)
    new_id: dict[int, int] = {}
    ops = []
    for i in order:
        op = graph.ops[i]
        start = sum(o.num_outputs for o in ops)
        for j in range(op.num_outputs):
            new_id[first[i] + j] = start + j
        ops.append(Op(op.kind, tuple(new_id[t] for t in op.inputs), op.attrs, op.block))
    return KernelGraph(tuple(ops), tuple(new_id[t] for t in graph.outputs)).validate()


@st.composite
def graphs_and_orders(draw):
    graph = draw(kernel_graphs())
    producers = graph.tensor_producers
    deps = [{producers[t][0] for t in op.inputs} for op in graph.ops]
    inputs = [i for i, op in enumerate(graph.ops) if op.kind == "input"]
    order: list[int] = []
    while len(order) < len(graph.ops):
        placed = set(order)
        next_input = next((i for i in inputs if i not in placed), None)
        ready = [i for i in range(len(graph.ops)) if i not in placed and deps[i] <= placed and (graph.ops[i].kind != "input" or i == next_input)]
        order.append(draw(st.sampled_from(ready)))
    return graph, order


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(kernel_graphs())
def test_round_trip_is_exact(graph):
    text = to_json(graph)
    back = from_json(text)
    assert back == graph
    assert to_json(back) == text
    assert from_json(to_json(graph, indent=1)) == graph
    assert content_hash(back) == content_hash(graph)


@PROPERTY
@given(graphs_and_orders())
def test_hash_ignores_operator_order_and_input_names(pair):
    graph, order = pair
    moved = _reordered(graph, order)
    assert moved.info[moved.outputs[0]] == graph.info[graph.outputs[0]]
    assert content_hash(moved) == content_hash(graph)
    renamed = KernelGraph(
        tuple(Op.make("input", name=f"renamed_{i}", **{k: v for k, v in op.attrs if k != "name"}) if op.kind == "input" else op for i, op in enumerate(graph.ops)),
        graph.outputs,
    )
    assert renamed != graph
    assert content_hash(renamed) == content_hash(graph)


@PROPERTY
@given(kernel_graphs(), st.data())
def test_hash_changes_with_dtype_and_operator_parameters(graph, data):
    dtype = graph.input_ops[0].attr("dtype")
    other = data.draw(st.sampled_from([d for d in DTYPES if d != dtype]))
    retyped = KernelGraph(tuple(Op.make("input", **{**op.a, "dtype": other}) if op.kind == "input" else op for op in graph.ops), graph.outputs)
    assert content_hash(retyped) != content_hash(graph)
    # prepend an exp to the first output: a different function, a different hash
    out = graph.outputs[0]
    changed = KernelGraph(graph.ops + (Op.make("unary", (out,), fn="exp"),), (graph.num_tensors,) + graph.outputs[1:])
    assert content_hash(changed) != content_hash(graph)


def test_hash_changes_with_shapes_attributes_and_schedule():
    base = fused_lora(5, 64, 32, 8, n_blocks=4, loop=2)
    h = content_hash(base)
    assert len(h) == 64 and int(h, 16) >= 0
    assert content_hash(fused_lora(5, 64, 32, 8, n_blocks=4, loop=2)) == h
    assert content_hash(fused_lora(5, 64, 64, 8, n_blocks=4, loop=2)) != h  # shape
    assert content_hash(fused_lora(5, 64, 32, 8, n_blocks=4, loop=2, scale=3.0)) != h  # attribute
    assert content_hash(fused_lora(5, 64, 32, 8, n_blocks=4, loop=4)) != h  # for-loop range
    assert content_hash(fused_lora(5, 64, 32, 8, n_blocks=2, loop=2)) != h  # grid
    assert content_hash(fused_lora(5, 64, 32, 8, n_blocks=4, loop=2, dtype="float16")) != h
    assert content_hash(fused_rmsnorm_linear(4, 64, 48, 6, 4, eps=1e-5)) != content_hash(fused_rmsnorm_linear(4, 64, 48, 6, 4))


def test_hash_is_stable_across_versions():
    # Cache keys depend on this value: change it only together with the cache schema version.
    g = GraphBuilder()
    x, w = g.input("X", (2, 8)), g.input("W", (8, 4))
    graph = g.build([g.unary("exp", g.matmul(x, w))])
    assert content_hash(graph) == "1fceba4dcf85e8dc261c2b6e1fec074fc6359cc6db91cdfb67e2eced8a2c5a86"


# --- malformed input ---------------------------------------------------------------------------


def _obj() -> dict:
    return json.loads(to_json(split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4)))


def _mutated(f) -> str:
    o = _obj()
    f(o)
    return json.dumps(o)


def _deep(n: int):
    v: object = 1
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"format": "mirage-serve.mugraph",', r"malformed μGraph JSON: Expecting"),
        (b"\xff\xfe{}", r"malformed μGraph JSON"),
        ("[" * 100000 + "]" * 100000, rf"nested deeper than {MAX_JSON_DEPTH} levels"),
        (json.dumps({"format": "mirage-serve.mugraph", "version": 1, "kernel": {"ops": [], "outputs": _deep(20)}}), rf"nested deeper than {MAX_JSON_DEPTH}"),
        ("[]", r"at top level: expected dict, got list"),
        (_mutated(lambda o: o.pop("kernel")), r"at top level: missing key\(s\) \['kernel'\]"),
        (_mutated(lambda o: o.update(extra=1)), r"at top level: unexpected key\(s\) \['extra'\]"),
        (_mutated(lambda o: o.update(format="mirage")), r"not a mirage-serve μGraph \(format 'mirage'\)"),
        (_mutated(lambda o: o.update(version=2)), r"version 2 is not supported \(this build reads version 1\)"),
        (_mutated(lambda o: o.update(version="1")), r"version '1' is not supported"),
        (_mutated(lambda o: o["kernel"].update(ops={})), r"at kernel.ops: expected list, got dict"),
        (_mutated(lambda o: o["kernel"]["ops"][0].pop("kind")), r"at kernel.ops\[0\]: missing key\(s\) \['kind'\]"),
        (_mutated(lambda o: o["kernel"]["ops"][0].update(extra=[])), r"at kernel.ops\[0\]: unexpected key\(s\) \['extra'\]"),
        (_mutated(lambda o: o["kernel"]["ops"][3].update(inputs=["0", 1, 2])), r"at kernel.ops\[3\].inputs\[0\]: expected int, got str"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"].update(grid=[True, 3])), r"kernel.ops\[3\].block.grid\[0\]: expected int, got bool"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"].update(forloop_range=4.0)), r"forloop_range: expected int, got float"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"]["inputs"][0].pop("forloop_dim")), r"block.inputs\[0\]: missing key\(s\) \['forloop_dim'\]"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"]["outputs"][0].update(tensor=None)), r"block.outputs\[0\]: expected int, got NoneType"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"]["ops"][0].update(kind="conv")), r"block.ops\[0\]: unknown operator kind 'conv'"),
        (_mutated(lambda o: o["kernel"]["ops"][0].update(kind="einsum")), r"kernel.ops\[0\]: unknown operator kind 'einsum'"),
        (_mutated(lambda o: o["kernel"]["ops"][0]["attrs"].update(dtype="int8")), r"dtype 'int8' not supported"),
        (_mutated(lambda o: o["kernel"]["ops"][0]["attrs"].update(shape=[4, "8"])), r"kernel.ops\[0\].attrs.shape: expected int, got str"),
        (_mutated(lambda o: o["kernel"]["ops"][0]["attrs"].update(color="red")), r"operator 'input' takes no attribute\(s\) \['color'\]"),
        (_mutated(lambda o: o["kernel"]["ops"][0].update(block=o["kernel"]["ops"][3]["block"])), r"only kernel-level customized operators carry a block graph"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"]["ops"][2].update(attrs={"scalar": float("nan"), "fn": "mul_scalar"})), r"non-finite number"),
        (_mutated(lambda o: o["kernel"].update(outputs=[99])), r"kernel graph output 99 is not a tensor"),
        (_mutated(lambda o: o["kernel"]["ops"][3]["block"]["inputs"][1].update(forloop_dim=0)), r"block input 1: for-loop dim 0 \(size 1 per block\) does not divide into 4 iterations"),
    ],
    ids=lambda v: v[:60] if isinstance(v, str) else None,
)
def test_malformed_json_raises(text, pattern):
    with pytest.raises(MuGraphError, match=pattern):
        from_json(text)


def test_operator_count_limit():
    ops = [{"kind": "input", "inputs": [], "attrs": {"name": "X", "shape": [1], "dtype": "float32"}}]
    ops += [{"kind": "unary", "inputs": [k], "attrs": {"fn": "exp"}} for k in range(MAX_OPS)]
    text = json.dumps({"format": "mirage-serve.mugraph", "version": 1, "kernel": {"ops": ops, "outputs": [MAX_OPS]}})
    with pytest.raises(MuGraphError, match=rf"{MAX_OPS + 1} operators exceeds the limit of {MAX_OPS}"):
        from_json(text)
    assert len(from_json(json.dumps({**json.loads(text), "kernel": {"ops": ops[:10], "outputs": [9]}})).ops) == 10


def test_canonical_text_is_sorted_and_compact():
    graph = fused_lora(5, 64, 32, 8, n_blocks=4, loop=2)
    text = to_json(graph)
    assert " " not in text and text == json.dumps(graph_to_obj(graph), sort_keys=True, separators=(",", ":"))
    assert text.startswith('{"format":"mirage-serve.mugraph","kernel":')
