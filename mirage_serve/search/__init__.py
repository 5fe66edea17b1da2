"""The superoptimizer: two-level enumeration of μGraphs, abstract-expression
pruning, verification and ranking (see ``driver.superoptimize``)."""

from mirage_serve.search.config import GpuTarget, SearchConfig
from mirage_serve.search.driver import Candidate, SearchResult, SearchStats, superoptimize

__all__ = ["Candidate", "GpuTarget", "SearchConfig", "SearchResult", "SearchStats", "superoptimize"]
