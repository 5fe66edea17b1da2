"""mirage-serve: a superoptimizer for the kernels of LLM inference."""

__version__ = "0.1.0"
