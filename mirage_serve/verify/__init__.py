"""Equivalence verification of μGraphs: finite-field random testing, a float check, certificates."""

from mirage_serve.verify.certificate import VERDICTS, Certificate, Verifier, verify_equivalent
from mirage_serve.verify.finite_field import FieldResult, FieldVerifier, field_check, signature_mismatch
from mirage_serve.verify.float_check import TOLERANCES, FloatReport, float_check

__all__ = [
    "TOLERANCES",
    "VERDICTS",
    "Certificate",
    "Verifier",
    "FieldResult",
    "FieldVerifier",
    "FloatReport",
    "field_check",
    "float_check",
    "signature_mismatch",
    "verify_equivalent",
]
