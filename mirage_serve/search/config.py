"""Limits and knobs of the superoptimizer (:class:`SearchConfig`) and the GPU
target the cost model and the shared-memory check assume (:class:`GpuTarget`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from mirage_serve.mugraph.graph import MuGraphError


@dataclass(frozen=True)
class GpuTarget:
    """What the analytical cost model needs to know about a GPU (defaults: H100 SXM)."""

    name: str = "H100"
    num_sms: int = 132
    smem_per_block: int = 227 * 1024  # bytes of shared memory one block may use
    dram_bandwidth: float = 3.35e12  # bytes/s
    flops: float = 495e12  # dense bf16/fp16 tensor-core FLOP/s
    launch_s: float = 4e-6  # fixed cost per kernel launch


H100 = GpuTarget()
H200 = GpuTarget(name="H200", dram_bandwidth=4.8e12)
TARGETS = {"H100": H100, "H200": H200}


@dataclass(frozen=True)
class SearchConfig:
    """Bounds of the search space, resources and reproducibility.

    Structural limits bound the operator structure that is enumerated (once per
    choice of input maps and loop dims); the instantiation sets list the concrete
    sizes tried for each structurally complete candidate.
    """

    # kernel level
    max_kernel_ops: int = 3  # non-input operators of a kernel graph
    max_customized: int = 2  # customized (block-graph) operators among them
    max_block_inputs: int = 4
    # block level
    max_block_ops: int = 7
    max_block_outputs: int = 3
    max_grid_dims: int = 2
    # instantiation (concrete sizes for structurally complete candidates)
    tile_widths: tuple[int, ...] = (16, 32, 64, 128)  # output elements per block along a tiled grid dim
    small_grid_extent: int = 64  # dims up to this extent may also get one block per element
    loop_chunks: tuple[int, ...] = (64, 128, 256, 512)  # elements per iteration along the loop dim
    splits: tuple[int, ...] = (2, 4, 8, 16, 32, 64)  # grid sizes of dims that produce partial results
    instantiations_per_structure: int = 2  # best-ranked concrete sizes verified per structure
    max_instantiations: int = 4096  # concrete size combinations costed per structure
    target: GpuTarget = field(default_factory=GpuTarget)
    # pruning
    prune: bool = True  # abstract-expression pruning (off: only the structural rules)
    solver: bool = False  # the e-graph confirms each normal-form rejection (docs/abstract-expressions.md)
    rewrites: bool = True  # also verify the exp-shifted and loop-split forms of every verified structure (search/rewrite.py)
    split_outputs: bool = True  # also search specs with an output other outputs are computed from in two parts (search/split.py)
    # verification
    trials: int = 3
    float_check: bool = True
    # resources
    time_budget_s: float | None = 600.0
    # once the best verified candidate keeps the spec's max guards (numerically safe), stop when no better
    # one came for max(patience_s, the time the best took to find): a search that found its best late is
    # given as long again (None: run until the budget or the space is exhausted)
    patience_s: float | None = None
    jobs: int = 2
    max_states: int = 20000  # kernel-graph prefixes kept per level (memory bound)
    first_block_nodes: int = 2000  # block-graph prefixes per map choice in the first round of a level
    max_block_nodes: int = 200000  # block-graph prefixes per map choice in the last round (rounds grow 4x)
    max_candidates: int = 64  # verified candidates kept
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        positive = ("max_kernel_ops", "max_customized", "max_block_inputs", "max_block_ops", "max_block_outputs",
                    "max_grid_dims", "instantiations_per_structure", "max_instantiations", "trials", "jobs",
                    "max_states", "first_block_nodes", "max_block_nodes", "max_candidates")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MuGraphError(f"SearchConfig.{name}={v!r} must be a positive integer")
        if self.max_grid_dims > 3:
            raise MuGraphError(f"SearchConfig.max_grid_dims={self.max_grid_dims} exceeds the 3 grid dims a block graph may have")
        for name in ("tile_widths", "loop_chunks", "splits"):
            v = getattr(self, name)
            if not v or any(not isinstance(x, int) or x < 1 for x in v):
                raise MuGraphError(f"SearchConfig.{name}={v!r} must be a non-empty tuple of positive integers")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise MuGraphError(f"SearchConfig.time_budget_s={self.time_budget_s!r} must be positive (or None for no limit)")
        if self.patience_s is not None and not self.patience_s > 0:
            raise MuGraphError(f"SearchConfig.patience_s={self.patience_s!r} must be positive (or None to search until the budget)")

    def replace(self, **changes) -> SearchConfig:
        """A copy with some fields changed (validated again)."""
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise MuGraphError(f"SearchConfig has no field(s) {sorted(unknown)}; fields: {sorted(names)}")
        return replace(self, **changes)
