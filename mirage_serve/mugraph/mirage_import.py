"""Import upstream Mirage's μGraph JSON (the 2024 ``saved_mugraphs`` form) into our IR.

An upstream file is a JSON array of kernel graphs; a kernel graph is an array of
operators (``op_type``, ``input_tensors``, ``output_tensors``), tensors being
referenced by ``guid``. We renumber tensors positionally, turn each
``kn_customized_op``'s ``bgraph`` into a :class:`BlockGraph`, and then check
every tensor shape and dtype the file declares against what our shape rules
infer, so a construct we model differently is reported rather than silently
mis-imported.

Choices the format leaves open, made here once:

* Grid dims come from ``grid_dim`` {x, y, z} with trailing size-1 dims dropped
  (at least one dim kept); map entries for grid dims of size 1 become -1 (or
  are dropped with their dim), since splitting over one block is no split at all.
* Data-type codes follow the 2024 numbering (920 bfloat16, 921 float16, 930
  float32); a graph spelled with the later ``tb_forloop_accum_*`` names uses
  the later numbering (940 bfloat16, 941 float16, 950 float32).
* ``tb_accum_red_ld_mean`` becomes ``sum_last`` followed by a ``mul_scalar`` of
  1 / (loop range × last dim); ``tb_mul_scalar_op`` needs a ``scalar`` field,
  which upstream's 2024 writer does not record, so such graphs are refused.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from mirage_serve.mugraph.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.shapes import block_tile_infos, row_major_strides

log = logging.getLogger(__name__)

DTYPE_CODES_2024 = {920: "bfloat16", 921: "float16", 930: "float32"}
DTYPE_CODES_LATER = {940: "bfloat16", 941: "float16", 950: "float32"}

_UNARY = {"exp": "exp", "square": "square", "sqrt": "sqrt", "silu": "silu", "rsqrt": "rsqrt", "neg": "neg"}
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div"}
# accumulator suffix (after tb_accum_ / tb_forloop_accum_) -> our accum fn
_ACCUMS = {"nored": "sum", "red_ld_sum": "sum_last", "red_ld_rms": "rms_last", "redtox_ld_sum": "sum_to", "red_ld_mean": "sum_last"}
_GRID_AXES = ("x", "y", "z")


def _err(where: str, msg: str) -> MuGraphError:
    return MuGraphError(f"upstream Mirage graph, {where}: {msg}")


def _field(obj: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise _err(where, f"expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise _err(where, f"missing field {key!r}")
    v = obj[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is int):
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise _err(where, f"field {key!r} should be {name}, got {type(v).__name__}")
    return v


def _tensor(t: Any, where: str, codes: dict[int, str]) -> tuple[int, tuple[int, ...], str]:
    """(guid, shape, dtype) of an upstream tensor description."""
    guid = _field(t, "guid", int, where)
    dims = _field(t, "dim", list, where)
    n = _field(t, "num_dims", int, where)
    if not 1 <= n <= len(dims) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims[:n]):
        raise _err(where, f"tensor {guid}: num_dims {n} does not fit dim {dims}")
    code = _field(t, "data_type", int, where)
    if code not in codes:
        known = ", ".join(f"{c} ({d})" for c, d in sorted(codes.items()))
        numbering = "2024" if codes is DTYPE_CODES_2024 else "later (tb_forloop_accum_* spelling)"
        raise _err(where, f"tensor {guid}: data_type code {code} is not supported; known codes in the {numbering} numbering: {known}")
    return guid, tuple(dims[:n]), codes[code]


def _grid_of(bgraph: dict, where: str) -> tuple[int, ...]:
    gd = _field(bgraph, "grid_dim", dict, where)
    full = []
    for a in _GRID_AXES:
        v = _field(gd, a, int, f"{where}.grid_dim")
        if v < 1:
            raise _err(where, f"grid_dim.{a} = {v} must be positive")
        full.append(v)
    while len(full) > 1 and full[-1] == 1:
        full.pop()
    return tuple(full)


def _map_of(m: Any, grid: tuple[int, ...], key: str, where: str) -> tuple[int, ...]:
    if not isinstance(m, dict):
        raise _err(where, f"{key} should be an object with x, y, z entries, got {type(m).__name__}")
    out = []
    for g, a in enumerate(_GRID_AXES):
        v = _field(m, a, int, f"{where}.{key}")
        if v < -1:
            raise _err(where, f"{key}.{a} = {v}; expected a tensor dim or -1")
        if g < len(grid):
            out.append(v if grid[g] > 1 else -1)  # a grid dim of size 1 splits nothing
    return tuple(out)


def _is_later_spelling(obj: list) -> bool:
    for op in obj:
        if isinstance(op, dict):
            if str(op.get("op_type", "")).startswith("tb_forloop_accum_"):
                return True
            bg = op.get("bgraph")
            if isinstance(bg, dict) and isinstance(bg.get("operators"), list) and _is_later_spelling(bg["operators"]):
                return True
    return False


def _elementwise(kind_prefix: str, op_type: str) -> tuple[str, str] | None:
    """('unary'|'binary', fn) for ``kn_exp_op``-style names, else None."""
    if not (op_type.startswith(kind_prefix) and op_type.endswith("_op")):
        return None
    name = op_type[len(kind_prefix) : -3]
    if name in _UNARY:
        return "unary", _UNARY[name]
    if name in _BINARY:
        return "binary", _BINARY[name]
    return None


def _numbered(op_type: str, prefix: str, suffix: str) -> int | None:
    """N for names like ``tb_reduction_N_max_op`` (prefix ``tb_reduction_``, suffix ``_max_op``)."""
    if op_type.startswith(prefix) and op_type.endswith(suffix):
        mid = op_type[len(prefix) : len(op_type) - len(suffix)]
        if mid in ("0", "1", "2", "3"):
            return int(mid)
    return None


class _Importer:
    def __init__(self, codes: dict[int, str]) -> None:
        self.codes = codes
        # (guid, declared shape, declared dtype, where) per kernel tensor id
        self.declared: list[tuple[int, tuple[int, ...], str, str]] = []
        self.ids: dict[int, int] = {}
        self.ops: list[Op] = []
        self.outputs: list[int] = []
        self.block_checks: list[tuple[int, list[tuple[int, int, tuple[int, ...], str]]]] = []

    def _out_tensors(self, op: dict, where: str, n: int | None) -> list[tuple[int, tuple[int, ...], str]]:
        outs = [_tensor(t, f"{where}.output_tensors[{j}]", self.codes) for j, t in enumerate(_field(op, "output_tensors", list, where))]
        if n is not None and len(outs) != n:
            raise _err(where, f"expected {n} output tensor(s), got {len(outs)}")
        return outs

    def _in_ids(self, op: dict, where: str, ids: dict[int, int]) -> list[int]:
        out = []
        for j, t in enumerate(_field(op, "input_tensors", list, where)):
            guid = _field(t, "guid", int, f"{where}.input_tensors[{j}]")
            if guid not in ids:
                raise _err(where, f"input tensor guid {guid} is not produced by an earlier operator")
            out.append(ids[guid])
        return out

    def _declare(self, outs: list[tuple[int, tuple[int, ...], str]], where: str) -> None:
        for guid, shape, dtype in outs:
            self.ids[guid] = len(self.declared)
            self.declared.append((guid, shape, dtype, where))

    def kernel_op(self, i: int, op: Any) -> None:
        where = f"kernel op {i}"
        op_type = _field(op, "op_type", str, where)
        where = f"kernel op {i} ({op_type})"
        if op_type == "kn_input_op":
            ((guid, shape, dtype),) = self._out_tensors(op, where, 1)
            imap = op.get("input_map", {})
            if isinstance(imap, dict) and any(v != -1 for v in imap.values()):
                raise _err(where, f"input_map {imap} distributes the input over devices, which mirage-serve does not model")
            strides = op.get("input_strides")
            if strides is not None:
                if not isinstance(strides, list) or len(strides) != len(shape) or not all(isinstance(x, int) and x > 0 for x in strides):
                    raise _err(where, f"input_strides {strides!r} should be {len(shape)} positive integers")
                strides = None if tuple(strides) == row_major_strides(shape) else tuple(strides)
            name = f"input{sum(o.kind == 'input' for o in self.ops)}"
            self.ops.append(Op.make("input", name=name, shape=shape, dtype=dtype, strides=strides))
            self._declare([(guid, shape, dtype)], where)
            return
        if op_type == "kn_output_op":
            ins = self._in_ids(op, where, self.ids)
            if len(ins) != 1:
                raise _err(where, f"kn_output_op takes exactly one input tensor, got {len(ins)}")
            t = ins[0]
            strides = op.get("output_strides")
            shape = self.declared[t][1]
            if strides is not None and tuple(strides) != row_major_strides(shape):
                log.warning("%s: output strides %s are not row-major; mirage-serve writes outputs contiguously", where, strides)
            self.outputs.append(t)
            return
        ins = self._in_ids(op, where, self.ids)
        if op_type == "kn_customized_op":
            in_guids = [_field(t, "guid", int, where) for t in op["input_tensors"]]
            outs = self._out_tensors(op, where, None)
            block, checks = self.block(_field(op, "bgraph", dict, where), in_guids, [g for g, _, _ in outs], where)
            self.ops.append(Op.make("customized", ins, block=block))
            self.block_checks.append((len(self.ops) - 1, checks))
            self._declare(outs, where)
            return
        outs = self._out_tensors(op, where, 1)
        self.ops.append(self._tile_like(op_type, "kn_", ins, outs[0][1], None, where))
        self._declare(outs, where)

    def _tile_like(self, op_type: str, prefix: str, ins: list[int], out_shape: tuple[int, ...], dimx: int | None, where: str) -> Op:
        """Operators both levels share: matmul, element-wise, reductions, rms_norm, concat."""
        if op_type == f"{prefix}matmul_op":
            return Op.make("matmul", ins)
        ew = _elementwise(prefix, op_type)
        if ew is not None:
            return Op.make(ew[0], ins, fn=ew[1])
        if op_type == f"{prefix}mul_scalar_op":
            raise _err(where, "mul_scalar's scalar is not recorded in this file format; re-export the graph with the scalar")
        if op_type == f"{prefix}rms_norm_op":
            if len(ins) != 1:
                raise _err(where, f"rms_norm with {len(ins)} inputs; only the weightless form is known")
            return Op.make("rms_norm", ins, eps=0.0)
        for suffix, fn in (("_op", "sum"), ("_max_op", "max"), ("_to_dimx_op", "sum_to")):
            d = _numbered(op_type, f"{prefix}reduction_", suffix)
            if d is None:
                continue
            if d >= len(out_shape):
                raise _err(where, f"reduces dim {d} of a rank-{len(out_shape)} tensor")
            if out_shape[d] == 1 and fn != "sum_to":
                return Op.make("reduce", ins, fn=fn, dim=d, keepdim=True)
            if fn != "max" and prefix == "tb_" and d == len(out_shape) - 1 and out_shape[d] == dimx:
                return Op.make("sum_to", ins, size=dimx)
            raise _err(where, f"reduction of dim {d} to size {out_shape[d]} is not expressible (only to 1, or the last dim to reduction_dimx in a block)")
        d = _numbered(op_type, f"{prefix}concat_", "_op")
        if d is not None:
            return Op.make("concat", ins, dim=d)
        raise _err(where, f"unknown operator type {op_type!r}")

    def block(self, bg: dict, in_guids: list[int], out_guids: list[int], where: str):
        grid = _grid_of(bg, where)
        rng = _field(bg, "forloop_range", int, where)
        dimx = bg.get("reduction_dimx")
        raw = _field(bg, "operators", list, where)
        ids: dict[int, int] = {}
        inputs: list[BlockInput] = []
        checks: list[tuple[int, int, tuple[int, ...], str]] = []  # (tile id, guid, declared shape, where)
        # Inputs have no operands, so gathering them first keeps the order valid.
        for j, bop in enumerate(raw):
            w = f"{where}, block op {j}"
            if _field(bop, "op_type", str, w) != "tb_input_op":
                continue
            w = f"{w} (tb_input_op)"
            src_guid = _field(_field(bop, "dtensor", dict, w), "guid", int, f"{w}.dtensor")
            if src_guid not in in_guids:
                raise _err(w, f"loads kernel tensor {src_guid}, which is not an input of the customized operator")
            fdim = _field(bop, "forloop_dim", int, w)
            imap = _map_of(_field(bop, "input_map", dict, w), grid, "input_map", w)
            ((guid, shape, _),) = self._out_tensors(bop, w, 1)
            ids[guid] = len(inputs)
            checks.append((len(inputs), guid, shape, w))
            inputs.append(BlockInput(in_guids.index(src_guid), imap, fdim))
        ops: list[Op] = []
        written: dict[int, BlockOutput] = {}
        for j, bop in enumerate(raw):
            op_type = bop["op_type"]
            w = f"{where}, block op {j} ({op_type})"
            if op_type == "tb_input_op":
                continue
            operands = self._in_ids(bop, w, ids)
            if op_type == "tb_output_op":
                dst = _field(_field(bop, "dtensor", dict, w), "guid", int, f"{w}.dtensor")
                if dst not in out_guids:
                    raise _err(w, f"writes kernel tensor {dst}, which is not an output of the customized operator")
                if dst in written:
                    raise _err(w, f"kernel tensor {dst} is written twice")
                if len(operands) != 1:
                    raise _err(w, f"expected one input tile, got {len(operands)}")
                written[dst] = BlockOutput(operands[0], _map_of(_field(bop, "output_map", dict, w), grid, "output_map", w))
                continue
            ((guid, shape, _),) = self._out_tensors(bop, w, 1)
            accum = None
            for pre in ("tb_accum_", "tb_forloop_accum_"):
                if op_type.startswith(pre) and op_type.endswith("_op"):
                    accum = op_type[len(pre) : -3]
            if accum is not None:
                if accum not in _ACCUMS:
                    raise _err(w, f"unknown accumulator type {op_type!r}; known: {sorted(_ACCUMS)}")
                fn = _ACCUMS[accum]
                if fn == "sum_to" and not isinstance(dimx, int):
                    raise _err(w, "redtox_ld_sum needs the block graph's reduction_dimx")
                ops.append(Op.make("accum", operands, fn=fn, size=dimx if fn == "sum_to" else None))
                if accum == "red_ld_mean":
                    n_last = next(shape_[-1] for t, _, shape_, _ in checks if t == operands[0])
                    ops.append(Op.make("unary", (len(inputs) + len(ops) - 1,), fn="mul_scalar", scalar=1.0 / (rng * n_last)))
            else:
                ops.append(self._tile_like(op_type, "tb_", operands, shape, dimx, w))
            tid = len(inputs) + len(ops) - 1
            ids[guid] = tid
            checks.append((tid, guid, shape, w))
        missing = [g for g in out_guids if g not in written]
        if missing:
            raise _err(where, f"output tensor(s) {missing} of the customized operator are written by no tb_output_op")
        outputs = tuple(written[g] for g in out_guids)
        return BlockGraph(grid, rng, tuple(inputs), tuple(ops), outputs), checks

    def build(self) -> KernelGraph:
        if not self.outputs:
            raise _err("graph", "no kn_output_op marks an output")
        try:
            graph = KernelGraph(tuple(self.ops), tuple(self.outputs)).validate()
        except MuGraphError as e:
            raise MuGraphError(f"upstream Mirage graph, as imported (block inputs numbered first): {e}") from None
        info = graph.info
        for tid, (guid, shape, dtype, where) in enumerate(self.declared):
            if info[tid].shape != shape or info[tid].dtype != dtype:
                raise _err(
                    where,
                    f"tensor {guid} is declared {dtype}{list(shape)} but imports as {info[tid].dtype}{list(info[tid].shape)}; "
                    "the graph uses a construct this importer models differently",
                )
        for op_index, checks in self.block_checks:
            op = graph.ops[op_index]
            tiles = block_tile_infos(op.block, [info[t] for t in op.inputs], f"kernel op {op_index}")
            for tid, guid, shape, where in checks:
                if tiles[tid].shape != shape:
                    raise _err(
                        where,
                        f"tile {guid} is declared {list(shape)} but imports as {list(tiles[tid].shape)}; "
                        "the graph uses a construct this importer models differently",
                    )
        return graph


def import_mirage_graph(obj: list) -> KernelGraph:
    """Convert one upstream Mirage kernel graph (a JSON array of operators) into a
    validated :class:`KernelGraph`; raises MuGraphError naming the operator and problem."""
    if not isinstance(obj, list):
        raise MuGraphError(f"an upstream Mirage kernel graph is a JSON array of operators, got {type(obj).__name__}")
    imp = _Importer(DTYPE_CODES_LATER if _is_later_spelling(obj) else DTYPE_CODES_2024)
    for i, op in enumerate(obj):
        imp.kernel_op(i, op)
    return imp.build()


def is_mirage_json(obj: Any) -> bool:
    """True for the upstream layout: an array of graphs (or one graph) of ``op_type`` objects."""
    if not isinstance(obj, list) or not obj:
        return False
    first = obj[0]
    if isinstance(first, list):
        return not first or isinstance(first[0], dict) and "op_type" in first[0]
    return isinstance(first, dict) and "op_type" in first


def import_mirage_obj(obj: Any) -> list[KernelGraph]:
    """Graphs of an already-parsed upstream file: an array of graphs, or a single graph."""
    if not is_mirage_json(obj):
        raise MuGraphError("not an upstream Mirage μGraph file: expected a JSON array of kernel graphs (arrays of objects with 'op_type')")
    graphs_obj = obj if isinstance(obj[0], list) else [obj]
    graphs = []
    for k, g in enumerate(graphs_obj):
        try:
            graphs.append(import_mirage_graph(g))
        except MuGraphError as e:
            raise MuGraphError(f"graph {k}: {e}") from None
    return graphs


def import_mirage_file(path: str | os.PathLike) -> list[KernelGraph]:
    """All kernel graphs of an upstream Mirage JSON file, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise MuGraphError(f"{path}: not valid JSON ({e})") from None
    try:
        graphs = import_mirage_obj(obj)
    except MuGraphError as e:
        raise MuGraphError(f"{path}: {e}") from None
    log.info("imported %d upstream Mirage graph(s) from %s", len(graphs), path)
    return graphs
