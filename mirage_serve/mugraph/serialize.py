"""The canonical, versioned JSON form of μGraphs and their content hash.

``to_json(from_json(s)) == s`` for every canonical string ``s``. The form::

    {"format": "mirage-serve.mugraph", "version": 1,
     "kernel": {"ops": [{"kind": ..., "inputs": [...], "attrs": {...}, "block": {...}}, ...],
                "outputs": [...]}}

``content_hash`` depends on structure, shapes, dtypes and operator parameters,
not on tensor numbering or the order of independent operators, nor on input names.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from mirage_serve.mugraph.graph import _ALLOWED_ATTRS, BlockGraph, BlockInput, BlockOutput, KernelGraph, MuGraphError, Op

FORMAT = "mirage-serve.mugraph"
VERSION = 1
MAX_JSON_DEPTH = 16
MAX_OPS = 4096


def _attrs_to_json(op: Op) -> dict[str, Any]:
    out = {}
    for k, v in op.attrs:
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _block_to_obj(b: BlockGraph) -> dict[str, Any]:
    return {
        "grid": list(b.grid),
        "forloop_range": b.forloop_range,
        "inputs": [{"source": i.source, "input_map": list(i.input_map), "forloop_dim": i.forloop_dim} for i in b.inputs],
        "ops": [_op_to_obj(op) for op in b.ops],
        "outputs": [{"tensor": o.tensor, "output_map": list(o.output_map)} for o in b.outputs],
    }


def _op_to_obj(op: Op) -> dict[str, Any]:
    obj: dict[str, Any] = {"kind": op.kind, "inputs": list(op.inputs)}
    if op.attrs:
        obj["attrs"] = _attrs_to_json(op)
    if op.block is not None:
        obj["block"] = _block_to_obj(op.block)
    return obj


def graph_to_obj(graph: KernelGraph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "kernel": {"ops": [_op_to_obj(op) for op in graph.ops], "outputs": list(graph.outputs)},
    }


def to_json(graph: KernelGraph, indent: int | None = None) -> str:
    """Canonical JSON text (sorted keys; compact unless ``indent`` is given)."""
    return json.dumps(graph_to_obj(graph), sort_keys=True, indent=indent, separators=(",", ":") if indent is None else None, allow_nan=False)


def _expect(obj: Any, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, typ) or isinstance(obj, bool) and typ is int:
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise MuGraphError(f"malformed μGraph JSON at {where}: expected {name}, got {type(obj).__name__}")
    return obj


def _int_list(obj: Any, where: str) -> tuple[int, ...]:
    _expect(obj, list, where)
    for j, v in enumerate(obj):
        _expect(v, int, f"{where}[{j}]")
    return tuple(obj)


def _keys(obj: dict, required: set[str], optional: set[str], where: str) -> None:
    missing = required - set(obj)
    if missing:
        raise MuGraphError(f"malformed μGraph JSON at {where}: missing key(s) {sorted(missing)}")
    extra = set(obj) - required - optional
    if extra:
        raise MuGraphError(f"malformed μGraph JSON at {where}: unexpected key(s) {sorted(extra)}")


def _attr_from_json(v: Any, where: str) -> Any:
    if isinstance(v, list):
        return tuple(_expect(x, int, where) for x in v)
    if isinstance(v, float) and not math.isfinite(v):
        raise MuGraphError(f"malformed μGraph JSON at {where}: non-finite number")
    _expect(v, (int, float, str, bool), where)
    return v


def _op_from_obj(obj: Any, where: str, level: str) -> Op:
    _expect(obj, dict, where)
    _keys(obj, {"kind", "inputs"}, {"attrs", "block"}, where)
    kind = _expect(obj["kind"], str, f"{where}.kind")
    if kind not in _ALLOWED_ATTRS:
        raise MuGraphError(f"{where}: unknown operator kind {kind!r}; known: {sorted(_ALLOWED_ATTRS)}")
    attrs_obj = _expect(obj.get("attrs", {}), dict, f"{where}.attrs")
    attrs = {k: _attr_from_json(v, f"{where}.attrs.{k}") for k, v in attrs_obj.items()}
    block = None
    if "block" in obj:
        if level != "kernel" or kind != "customized":
            raise MuGraphError(f"{where}: only kernel-level customized operators carry a block graph")
        block = _block_from_obj(obj["block"], f"{where}.block")
    return Op.make(kind, _int_list(obj["inputs"], f"{where}.inputs"), block=block, **attrs)


def _block_from_obj(obj: Any, where: str) -> BlockGraph:
    _expect(obj, dict, where)
    _keys(obj, {"grid", "forloop_range", "inputs", "ops", "outputs"}, set(), where)
    inputs = []
    for j, i in enumerate(_expect(obj["inputs"], list, f"{where}.inputs")):
        w = f"{where}.inputs[{j}]"
        _expect(i, dict, w)
        _keys(i, {"source", "input_map", "forloop_dim"}, set(), w)
        inputs.append(BlockInput(_expect(i["source"], int, w), _int_list(i["input_map"], w), _expect(i["forloop_dim"], int, w)))
    ops_obj = _expect(obj["ops"], list, f"{where}.ops")
    if len(ops_obj) > MAX_OPS:
        raise MuGraphError(f"{where}: {len(ops_obj)} operators exceeds the limit of {MAX_OPS}")
    ops = [_op_from_obj(o, f"{where}.ops[{j}]", "block") for j, o in enumerate(ops_obj)]
    outputs = []
    for j, o in enumerate(_expect(obj["outputs"], list, f"{where}.outputs")):
        w = f"{where}.outputs[{j}]"
        _expect(o, dict, w)
        _keys(o, {"tensor", "output_map"}, set(), w)
        outputs.append(BlockOutput(_expect(o["tensor"], int, w), _int_list(o["output_map"], w)))
    return BlockGraph(
        _int_list(obj["grid"], f"{where}.grid"), _expect(obj["forloop_range"], int, f"{where}.forloop_range"), tuple(inputs), tuple(ops), tuple(outputs)
    )


def json_depth(obj: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (iterative; stops counting past ``limit``)."""
    stack = [(obj, 1)]
    deepest = 0
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if d > limit:
            return d
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return deepest


def graph_from_obj(obj: Any) -> KernelGraph:
    """Parse and validate the canonical object form."""
    if json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise MuGraphError(f"malformed μGraph JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    _expect(obj, dict, "top level")
    _keys(obj, {"format", "version", "kernel"}, set(), "top level")
    if obj["format"] != FORMAT:
        raise MuGraphError(f"not a mirage-serve μGraph (format {obj['format']!r}); upstream Mirage files load with mirage_serve.mugraph.import_mirage")
    if obj["version"] != VERSION:
        raise MuGraphError(f"μGraph JSON version {obj['version']!r} is not supported (this build reads version {VERSION})")
    k = _expect(obj["kernel"], dict, "kernel")
    _keys(k, {"ops", "outputs"}, set(), "kernel")
    ops_obj = _expect(k["ops"], list, "kernel.ops")
    if len(ops_obj) > MAX_OPS:
        raise MuGraphError(f"kernel graph with {len(ops_obj)} operators exceeds the limit of {MAX_OPS}")
    ops = tuple(_op_from_obj(o, f"kernel.ops[{j}]", "kernel") for j, o in enumerate(ops_obj))
    return KernelGraph(ops, _int_list(k["outputs"], "kernel.outputs")).validate()


def from_json(text: str | bytes) -> KernelGraph:
    """Parse canonical μGraph JSON; raises MuGraphError with the place and reason."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MuGraphError(f"malformed μGraph JSON: {e}") from None
    except RecursionError:
        raise MuGraphError(f"malformed μGraph JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    return graph_from_obj(obj)


def _h(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _canon_map(m: tuple[int, ...], grid: tuple[int, ...]) -> list[int]:
    return [d if g > 1 else -1 for d, g in zip(m, grid, strict=False)]


def _attr_key(op: Op, drop: tuple[str, ...] = ()) -> list:
    return [[k, list(v) if isinstance(v, tuple) else v] for k, v in op.attrs if k not in drop]


def block_hash(b: BlockGraph, source_keys: list[str]) -> list[str]:
    """Hashes of a block graph's outputs, given hashes of its kernel inputs."""
    keys: list[str] = []
    for i in b.inputs:
        keys.append(_h("tile", source_keys[i.source], _canon_map(i.input_map, b.grid), i.forloop_dim))
    for op in b.ops:
        keys.append(_h(op.kind, _attr_key(op), [keys[t] for t in op.inputs]))
    return [_h("out", keys[o.tensor], _canon_map(o.output_map, b.grid)) for o in b.outputs] + [_h("grid", list(b.grid), b.forloop_range)]


def content_hash(graph: KernelGraph) -> str:
    """Stable sha256 of what a graph computes structurally: independent of tensor
    ids, input names and the order of independent operators."""
    info = graph.info
    keys: list[str] = []
    n_in = 0
    for op in graph.ops:
        if op.kind == "input":
            t = info[len(keys)]
            keys.append(_h("input", n_in, list(t.shape), t.dtype, list(op.attr("strides") or ())))
            n_in += 1
        elif op.kind == "customized":
            outs = block_hash(op.block, [keys[t] for t in op.inputs])
            keys.extend(_h("kout", j, outs[j], outs[-1]) for j in range(len(outs) - 1))
        else:
            keys.append(_h(op.kind, _attr_key(op), [keys[t] for t in op.inputs]))
    return _h("graph", [keys[t] for t in graph.outputs])
