"""Kernel-cache entries shipped with mirage-serve (data only)."""
