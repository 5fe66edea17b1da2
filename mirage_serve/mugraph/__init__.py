"""The μGraph IR: kernel graphs, block graphs, shape rules, JSON and Mirage import."""

from mirage_serve.mugraph.graph import (
    ACCUM_FNS,
    BINARY_FNS,
    DTYPES,
    REDUCE_FNS,
    UNARY_FNS,
    BlockBuilder,
    BlockGraph,
    BlockInput,
    BlockOutput,
    GraphBuilder,
    KernelGraph,
    MuGraphError,
    Op,
)
from mirage_serve.mugraph.serialize import content_hash, from_json, graph_from_obj, graph_to_obj, to_json
from mirage_serve.mugraph.shapes import TensorInfo

__all__ = [
    "ACCUM_FNS",
    "BINARY_FNS",
    "DTYPES",
    "REDUCE_FNS",
    "UNARY_FNS",
    "BlockBuilder",
    "BlockGraph",
    "BlockInput",
    "BlockOutput",
    "GraphBuilder",
    "KernelGraph",
    "MuGraphError",
    "Op",
    "TensorInfo",
    "content_hash",
    "from_json",
    "graph_from_obj",
    "graph_to_obj",
    "to_json",
]
