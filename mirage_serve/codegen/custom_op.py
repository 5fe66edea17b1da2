"""Register a compiled graph as a ``torch.library`` operator (namespace ``mirage_serve``).

The operator allocates its outputs, checks its inputs and has a fake (meta)
implementation computing output shapes from the graph's shape rules with the
actual row count, so it traces under torch.compile and captures in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mirage_serve.codegen.params import CodegenError, CodegenParams
from mirage_serve.codegen.runtime import CompiledGraph, compile_graph
from mirage_serve.mugraph import KernelGraph, content_hash
from mirage_serve.reference import TORCH_DTYPES

NAMESPACE = "mirage_serve"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_REGISTERED: dict[str, Callable[..., list[torch.Tensor]]] = {}


def op_name(graph: KernelGraph, params: CodegenParams) -> str:
    """``g_<graph hash>_<params hash>``: the same graph and params give the same name."""
    return f"g_{content_hash(graph)[:16]}_{params.key()}"


def _check(cg: CompiledGraph, name: str, tensors: tuple[torch.Tensor, ...]) -> int:
    if len(tensors) != len(cg.input_shapes):
        raise CodegenError(f"{NAMESPACE}::{name} takes {len(cg.input_shapes)} tensors, got {len(tensors)}")
    dev = tensors[0].device
    for pos, x in enumerate(tensors):
        if x.device != dev:
            raise CodegenError(f"{NAMESPACE}::{name}: input {pos} is on {x.device}, input 0 on {dev}; move them to one device")
        if not x.is_contiguous():
            raise CodegenError(f"{NAMESPACE}::{name}: input {pos} is not contiguous; call .contiguous() first")
    return cg.n_rows_of(tensors)


def register_custom_op(graph: KernelGraph, params: CodegenParams | None = None) -> Callable[..., list[torch.Tensor]]:
    """Register ``graph`` as ``torch.ops.mirage_serve.<name>``; returns a callable giving a list of outputs.

    Idempotent: registering the same graph with the same params returns the same callable."""
    params = params or CodegenParams()
    name = op_name(graph, params)
    if name in _REGISTERED:
        return _REGISTERED[name]
    cg = compile_graph(graph, params)
    n_in, n_out = len(cg.input_shapes), len(cg.output_shapes)
    args = ", ".join(f"Tensor x{j}" for j in range(n_in))
    ret = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    _LIB.define(f"{name}({args}) -> {ret}")

    def impl(*tensors: torch.Tensor):
        _check(cg, name, tensors)
        outs = cg(*tensors)
        return outs[0] if n_out == 1 else tuple(outs)

    def fake(*tensors: torch.Tensor):
        n = _check(cg, name, tensors)
        outs = [
            torch.empty(s, dtype=TORCH_DTYPES[d], device=tensors[0].device)
            for s, d in zip(cg.output_shapes_for(n), cg.output_dtypes, strict=True)
        ]
        return outs[0] if n_out == 1 else tuple(outs)

    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    opfn = getattr(torch.ops.mirage_serve, name).default

    def call(*tensors: torch.Tensor) -> list[torch.Tensor]:
        if len(tensors) != n_in:
            raise CodegenError(f"{NAMESPACE}::{name} takes {n_in} tensors, got {len(tensors)}")
        out = opfn(*tensors)
        return [out] if n_out == 1 else list(out)

    call.op = opfn  # type: ignore[attr-defined]
    call.compiled = cg  # type: ignore[attr-defined]
    _REGISTERED[name] = call
    return call
