"""Splitting a spec at an output that other outputs are computed from.

When one of a spec's outputs (say ``H = X + R``) is also an intermediate value
of another output (``Y = rms_norm(H, g) @ W^T``), every μGraph of the spec has
to write ``H`` to device memory anyway. Graphs that compute ``H`` first and
then compute the rest *from* ``H`` are then a natural part of the search space,
and they can be searched much faster as two smaller specs:

- the *head*: the operators ``H`` depends on, with ``H`` as its only output;
- the *tail*: the remaining operators, reading ``H`` as a new input (first, so
  the block graphs that read it are enumerated early).

:func:`output_split` finds such a split, :func:`stitch` joins a head graph and
a tail graph back into one graph over the spec's inputs and outputs. The
driver searches head and tail separately, stitches their best candidates and
verifies every stitched graph against the *whole* spec before it is kept, then
goes on with the undivided search with the rest of its budget (which also
covers graphs that do not compute ``H`` first).
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_serve.mugraph.graph import KernelGraph, Op


@dataclass(frozen=True)
class OutputSplit:
    """A spec cut at its output ``output_index`` (tensor ``tensor``)."""

    output_index: int
    tensor: int
    head: KernelGraph  # the spec's inputs ``head_inputs`` -> the output
    tail: KernelGraph  # (the output, the spec's inputs ``tail_inputs``) -> the other outputs, in order
    head_inputs: tuple[int, ...]  # spec tensor ids of the head's inputs, in order
    tail_inputs: tuple[int, ...]  # spec tensor ids of the tail's inputs after the first


def _ancestor_ops(spec: KernelGraph, tensor: int) -> set[int]:
    prod = spec.tensor_producers
    seen: set[int] = set()
    todo = [prod[tensor][0]]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        todo.extend(prod[t][0] for t in spec.ops[i].inputs)
    return seen


def _subgraph(spec: KernelGraph, inputs: list[tuple[int, Op]], op_ids: list[int], outputs: list[int]) -> KernelGraph:
    """A graph of ``inputs`` (spec tensor id, input op) then the spec's ops
    ``op_ids`` (in spec order), renumbered, with the spec tensors ``outputs``."""
    prod = spec.tensor_producers
    new_id: dict[int, int] = {}
    ops: list[Op] = []
    for t, op in inputs:
        new_id[t] = len(new_id)
        ops.append(op)
    n = len(new_id)
    first_tensor = {i: t for t, (i, j) in enumerate(prod) if j == 0}
    for i in op_ids:
        op = spec.ops[i]
        ops.append(Op(op.kind, tuple(new_id[t] for t in op.inputs), op.attrs, op.block))
        for j in range(op.num_outputs):
            new_id[first_tensor[i] + j] = n
            n += 1
    return KernelGraph(tuple(ops), tuple(new_id[t] for t in outputs)).validate()


def _input_name(spec: KernelGraph, index: int) -> str:
    names = {op.attr("name") for op in spec.input_ops}
    name, k = f"out{index}", 0
    while name in names:
        k += 1
        name = f"out{index}_{k}"
    return name


def output_split(spec: KernelGraph) -> OutputSplit | None:
    """The first split of ``spec`` at an output other outputs are computed from,
    or None. The split exists when the output is produced by an operator, some
    other output depends on it, and the operators outside its computation read
    only the spec's inputs, that output, or each other's results."""
    if len(spec.outputs) < 2:
        return None
    prod = spec.tensor_producers
    info = spec.info
    inputs = set(spec.input_ids)
    for index, t in enumerate(spec.outputs):
        if t in inputs or spec.outputs.count(t) > 1:
            continue
        others = [u for k, u in enumerate(spec.outputs) if k != index]
        head_ops = _ancestor_ops(spec, t)
        if not any(prod[t][0] in _ancestor_ops(spec, u) for u in others):
            continue
        tail_ops = [i for i, op in enumerate(spec.ops) if i not in head_ops and op.kind != "input"]
        tail_tensors = {u for u, (i, _) in enumerate(prod) if i in tail_ops}
        if not tail_ops or any(u not in tail_tensors for u in others):
            continue
        readable = inputs | {t} | tail_tensors
        if any(x not in readable for i in tail_ops for x in spec.ops[i].inputs):
            continue
        in_ops = {u: spec.ops[prod[u][0]] for u in spec.input_ids}
        head_in = [u for u in spec.input_ids if prod[u][0] in head_ops]
        tail_in = sorted({x for i in tail_ops for x in spec.ops[i].inputs if x in inputs})
        head = _subgraph(spec, [(u, in_ops[u]) for u in head_in],
                         sorted(i for i in head_ops if spec.ops[i].kind != "input"), [t])
        t_info = info[t]
        t_input = Op.make("input", name=_input_name(spec, index), shape=tuple(t_info.shape), dtype=t_info.dtype)
        tail = _subgraph(spec, [(t, t_input)] + [(u, in_ops[u]) for u in tail_in], tail_ops, others)
        return OutputSplit(index, t, head, tail, tuple(head_in), tuple(tail_in))
    return None


def _append(ops: list[Op], graph: KernelGraph, input_map: list[int], n_tensors: int) -> tuple[list[int], int]:
    """Append ``graph``'s non-input operators to ``ops``, its k-th input read as
    tensor ``input_map[k]``; returns the new ids of its tensors and the count."""
    ids: list[int] = []
    k = 0
    for op in graph.ops:
        if op.kind == "input":
            ids.append(input_map[k])
            k += 1
            continue
        ops.append(Op(op.kind, tuple(ids[t] for t in op.inputs), op.attrs, op.block))
        for _ in range(op.num_outputs):
            ids.append(n_tensors)
            n_tensors += 1
    return ids, n_tensors


def stitch(spec: KernelGraph, split: OutputSplit, head: KernelGraph, tail: KernelGraph) -> KernelGraph:
    """One graph over the spec's inputs: ``head`` (a graph of ``split.head``)
    computes the split output, ``tail`` (a graph of ``split.tail``) the others."""
    ops = [spec.ops[spec.tensor_producers[u][0]] for u in spec.input_ids]
    pos = {u: k for k, u in enumerate(spec.input_ids)}
    head_ids, n = _append(ops, head, [pos[u] for u in split.head_inputs], len(ops))
    h = head_ids[head.outputs[0]]
    tail_ids, _ = _append(ops, tail, [h] + [pos[u] for u in split.tail_inputs], n)
    rest = iter(tail_ids[u] for u in tail.outputs)
    outputs = tuple(h if k == split.output_index else next(rest) for k in range(len(spec.outputs)))
    return KernelGraph(tuple(ops), outputs).validate()
