"""Differential fuzzing of the reference executor, the verifier and the code generator.

``python -m mirage_serve.fuzz --minutes N --seed S`` generates random valid
kernel and block graphs (:mod:`mirage_serve.fuzz.programs`,
:mod:`mirage_serve.fuzz.kernels`), runs each through the float64 reference, the
finite-field verifier (against equivalent rewrites and mutants) and the
generated Triton kernel, minimises any disagreement and saves it as a
regression (:mod:`mirage_serve.fuzz.regressions`).
"""
