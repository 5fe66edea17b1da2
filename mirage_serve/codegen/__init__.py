"""Triton code generation for μGraphs, launch wrappers and torch custom operators."""

from mirage_serve.codegen.custom_op import register_custom_op
from mirage_serve.codegen.params import CodegenError, CodegenParams
from mirage_serve.codegen.runtime import CompiledGraph, compile_for_target, compile_graph, generate_source, load_kernel, supports

#: Version of the code generator, part of every kernel-cache key: bump it whenever the
#: source generated for the same μGraph and parameters changes, or a parameter is added.
CODEGEN_VERSION = "4"

__all__ = [
    "CODEGEN_VERSION",
    "CodegenError",
    "CodegenParams",
    "CompiledGraph",
    "compile_for_target",
    "compile_graph",
    "generate_source",
    "load_kernel",
    "register_custom_op",
    "supports",
]
