"""Numeric stand-ins for the abstract-expression engine and the verifier, for
exercising the enumeration machinery on tiny specs without either.

The stand-in "expression" of a tensor is its float64 value on fixed random
inputs: it recognises complete graphs (``matches_output``) but prunes nothing
(``is_possible_subexpr`` is always true), so the search it drives sees every
structurally valid prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mirage_serve.mugraph import KernelGraph
from mirage_serve.reference import execute, random_inputs
from mirage_serve.search.enumerate import ExprEngine


def _inputs(graph: KernelGraph, seed: int = 1234) -> list[torch.Tensor]:
    return random_inputs(graph, torch.Generator().manual_seed(seed), dtype=torch.float64)


class NumericAbstract:
    """graph_exprs = the value of every tensor on fixed inputs."""

    @staticmethod
    def graph_exprs(graph: KernelGraph) -> list[torch.Tensor]:
        full = KernelGraph(graph.ops, tuple(range(graph.num_tensors)))
        return execute(full, _inputs(full))

    @staticmethod
    def kernel_op_expr(op, input_exprs, input_infos):
        raise NotImplementedError

    @staticmethod
    def block_op_expr(op, input_exprs, input_infos, forloop_range):
        return None


class NumericOracle:
    def __init__(self, spec: KernelGraph) -> None:
        self.outs = execute(spec, _inputs(spec))
        self.stats = {"queries": 0}

    def is_possible_subexpr(self, expr) -> bool:
        self.stats["queries"] += 1
        return True

    def matches_output(self, expr, index: int) -> bool:
        ref = self.outs[index]
        return expr is not None and tuple(expr.shape) == tuple(ref.shape) and torch.allclose(expr, ref, rtol=1e-9, atol=1e-9)


def numeric_engine(spec: KernelGraph, prune: bool) -> ExprEngine:
    return ExprEngine(NumericAbstract(), NumericOracle(spec), prune)


@dataclass
class FloatCertificate:
    verdict: str
    max_err: float

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "max_err": self.max_err, "method": "float64 stand-in"}


def float_verifier(candidate: KernelGraph, spec: KernelGraph, *, trials: int = 2, seed: int = 0, float_check: bool = True):
    worst = 0.0
    for t in range(trials):
        ins = _inputs(spec, seed * 100 + t + 7)
        a, b = execute(candidate, ins), execute(spec, ins)
        if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
            return FloatCertificate("not_equivalent", float("inf"))
        worst = max(worst, max(float((x - y).abs().max() / (y.abs().max() + 1e-30)) for x, y in zip(a, b)))
    return FloatCertificate("equivalent" if worst < 1e-9 else "not_equivalent", worst)


def test_standin_engine_recognises_the_spec_itself():
    from mirage_serve.specs import build_spec

    spec = build_spec("gated_mlp", {"batch": 2, "hidden": 8, "intermediate": 4})
    eng = numeric_engine(spec, True)
    exprs = eng.graph_exprs(spec)
    assert eng.matches(exprs[spec.outputs[0]], 0)
    assert not eng.matches(exprs[0], 0)
    assert float_verifier(spec, spec).verdict == "equivalent"
