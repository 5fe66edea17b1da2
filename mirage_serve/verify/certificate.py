"""Certificates: what was checked, with which random draws, and the verdict.

:func:`verify_equivalent` runs the finite-field test
(:mod:`mirage_serve.verify.finite_field`) and, when that passes, the
floating-point check (:mod:`mirage_serve.verify.float_check`); "equivalent"
needs both. The certificate records everything needed to repeat the run (seed,
trials, primes, ω per trial, redraws, float errors and tolerances, versions) and
round-trips through :meth:`Certificate.to_dict` / :meth:`Certificate.from_dict`.
Apart from ``elapsed_s`` it is a deterministic function of the two graphs, the
arguments and the versions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch

import mirage_serve
from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.mugraph.serialize import content_hash
from mirage_serve.verify import float_check as _float
from mirage_serve.verify.finite_field import DEFAULT_TRIALS, FieldVerifier, signature_mismatch

log = logging.getLogger(__name__)

VERDICTS = ("equivalent", "not_equivalent", "unknown")
METHOD_FIELD = "finite-field Z_p x Z_q (exp = omega^x mod p)"
METHOD_FLOAT = "float check vs float64"
METHOD_ROWS = "on a row-reduced instance"
OPTIONAL_FIELDS = frozenset({"rows"})


def versions() -> dict[str, str]:
    """Versions that a verdict depends on."""
    return {"mirage_serve": mirage_serve.__version__, "torch": torch.__version__}


@dataclass
class Certificate:
    """The record of one verification. ``verdict`` is one of :data:`VERDICTS`."""

    verdict: str
    reason: str
    method: str
    trials: int  # trials requested
    seed: int
    primes: list[int] = field(default_factory=list)  # one per completed trial
    omegas: list[int] = field(default_factory=list)
    redraws: int = 0
    float_checks: list[_float.FloatReport] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=versions)
    candidate_hash: str = ""
    spec_hash: str = ""
    elapsed_s: float = 0.0
    # set when the pair was verified on fewer rows than it has (see mirage_serve.verify.rows):
    # {"rows": N, "verified_rows": n, "group": T}; the hashes above name the full-size graphs
    rows: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")

    @property
    def equivalent(self) -> bool:
        return self.verdict == "equivalent"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the form cache entries store)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["primes"], d["omegas"] = list(self.primes), list(self.omegas)
        d["float_checks"] = [r.to_dict() for r in self.float_checks]
        d["versions"] = dict(self.versions)
        if self.rows is None:
            del d["rows"]  # certificates of full-size verification keep their original form
        else:
            d["rows"] = dict(self.rows)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Certificate:
        """Inverse of :meth:`to_dict`. Strict: unknown or missing keys and wrong types
        raise ValueError naming them (a certificate from another format is not guessed at)."""
        if not isinstance(d, dict):
            raise ValueError(f"a certificate is a JSON object, got {type(d).__name__}")
        names = [f.name for f in fields(Certificate)]
        unknown = sorted(set(d) - set(names))
        missing = sorted(set(names) - set(d) - OPTIONAL_FIELDS)
        if unknown or missing:
            raise ValueError(f"certificate keys do not match: unknown {unknown}, missing {missing}; re-verify to get a current certificate")
        types = {"verdict": str, "reason": str, "method": str, "trials": int, "seed": int, "redraws": int,
                 "candidate_hash": str, "spec_hash": str, "elapsed_s": (int, float), "primes": list, "omegas": list,
                 "float_checks": list, "versions": dict}
        for k, t in types.items():
            if not isinstance(d[k], t) or (t is int and isinstance(d[k], bool)):
                raise ValueError(f"certificate field {k!r} has type {type(d[k]).__name__}")
        for k in ("primes", "omegas"):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in d[k]):
                raise ValueError(f"certificate field {k!r} must be a list of integers")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in d["versions"].items()):
            raise ValueError("certificate field 'versions' must map names to version strings")
        rows = d.get("rows")
        if rows is not None and not (isinstance(rows, dict) and set(rows) == {"rows", "verified_rows", "group"}
                                     and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rows.values())):
            raise ValueError("certificate field 'rows' must map rows, verified_rows and group to positive integers")
        return Certificate(
            verdict=d["verdict"], reason=d["reason"], method=d["method"], trials=d["trials"], seed=d["seed"],
            primes=list(d["primes"]), omegas=list(d["omegas"]), redraws=d["redraws"],
            float_checks=[_float.FloatReport.from_dict(r) for r in d["float_checks"]],
            versions=dict(d["versions"]), candidate_hash=d["candidate_hash"], spec_hash=d["spec_hash"],
            elapsed_s=float(d["elapsed_s"]), rows=None if rows is None else dict(rows),
        )

    def summary(self) -> str:
        """Human-readable lines: verdict, reason and what was drawn."""
        lines = [f"verdict: {self.verdict}", f"reason:  {self.reason}", f"method:  {self.method}",
                 f"trials:  {len(self.primes)} of {self.trials} completed (seed {self.seed}, {self.redraws} redraw(s))"]
        for j, (p, w) in enumerate(zip(self.primes, self.omegas)):
            lines.append(f"  trial {j + 1}: p={p}, q={(p - 1) // 2}, ω={w}")
        for r in self.float_checks:
            state = "pass" if r.passed else "FAIL"
            lines.append(f"float {r.dtype}: rel error {r.rel_error:.3g} (tolerance {r.tolerance:g}), max abs {r.max_abs_error:.3g}, "
                         f"input scale {r.scale:g}: {state}")
        if self.rows is not None:
            lines.append(f"rows:    verified on {self.rows['verified_rows']} of {self.rows['rows']} rows "
                         f"(both graphs row-separable, groups of {self.rows['group']})")
        lines.append(f"versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}; {self.elapsed_s:.2f}s")
        return "\n".join(lines)


class Verifier:
    """Verifies candidates against one spec, reusing the spec's evaluations
    (finite-field trials and float references) across candidates."""

    def __init__(self, spec: KernelGraph, *, trials: int = DEFAULT_TRIALS, seed: int = 0) -> None:
        self.spec = spec
        self.trials = trials
        self.seed = seed
        self.spec_hash = content_hash(spec)
        self.field = FieldVerifier(spec, trials=trials, seed=seed)
        self._float_refs: dict[str, _float.FloatReference] = {}

    def verify(
        self,
        candidate: KernelGraph,
        *,
        float_check: bool = True,
        float_dtype: str | None = None,
        run_candidate: _float.RunCandidate | None = None,
    ) -> Certificate:
        """See :func:`verify_equivalent`."""
        t0 = time.perf_counter()
        method = METHOD_FIELD + (f" + {METHOD_FLOAT}" if float_check else "")
        cert = Certificate("unknown", "", method, self.trials, self.seed, spec_hash=self.spec_hash)
        try:
            cert.candidate_hash = content_hash(candidate)
        except MuGraphError as e:
            cert.verdict, cert.reason = "not_equivalent", f"candidate is not a valid μGraph: {e}"
            cert.elapsed_s = time.perf_counter() - t0
            return cert
        res = self.field.check(candidate)
        cert.primes, cert.omegas, cert.redraws = list(res.primes), list(res.omegas), res.redraws
        cert.verdict, cert.reason = res.verdict, res.reason
        # A float failure is a concrete counterexample, so it also settles pairs the finite-field
        # model cannot decide ("unknown"); a float pass never turns "unknown" into "equivalent".
        if res.verdict in ("equivalent", "unknown") and float_check:
            dtype = float_dtype or _float.graph_dtype(candidate)
            if dtype not in self._float_refs:
                self._float_refs[dtype] = _float.float_reference(self.spec, dtype=dtype, seed=self.seed)
            report = _float.float_check(candidate, self.spec, dtype=dtype, seed=self.seed, run_candidate=run_candidate,
                                        reference=self._float_refs[dtype])
            cert.float_checks.append(report)
            if not report.conclusive:
                cert.verdict = "unknown"
                cert.reason = f"{res.reason}; but {report.reason}"
            elif not report.passed:
                cert.verdict = "not_equivalent"
                if res.verdict == "equivalent":
                    cert.reason = f"finite-field trials agree, but the float check fails: {report.reason}"
                else:
                    cert.reason = f"the float check fails: {report.reason} (finite field undecided: {res.reason})"
            elif res.verdict == "equivalent":
                cert.reason += f"; {report.dtype} float check passes (rel error {report.rel_error:.2g} <= {report.tolerance:g})"
            else:
                cert.reason += f"; the {report.dtype} float check passes, which does not decide the pair"
        cert.elapsed_s = time.perf_counter() - t0
        log.info("verify: %s (%s) in %.2fs", cert.verdict, cert.reason, cert.elapsed_s)
        return cert


def verify_equivalent(
    candidate: KernelGraph,
    spec: KernelGraph,
    *,
    trials: int = DEFAULT_TRIALS,
    seed: int = 0,
    float_check: bool = True,
    float_dtype: str | None = None,
    run_candidate: _float.RunCandidate | None = None,
    max_rows: int | None = None,
) -> Certificate:
    """Decide whether ``candidate`` computes ``spec``; returns the certificate.

    "equivalent" needs every finite-field trial to agree and (with ``float_check``)
    the float check in ``float_dtype`` (default: the candidate's dtype) to pass;
    a float failure after a finite-field pass is "not_equivalent" with the reason,
    and so is a float failure where the finite field could not decide ("unknown"
    otherwise stays "unknown").
    ``run_candidate`` runs a compiled kernel in the float check instead of the
    reference executor. ``max_rows`` caps the rows (dim 0 of the inputs) evaluated: a pair
    with more rows is verified on a row-reduced instance when both graphs are row-separable
    (:mod:`mirage_serve.verify.rows`; the certificate's ``rows`` says so) and is "unknown"
    otherwise. To check many candidates against one spec, build a :class:`Verifier` once and
    call its ``verify``."""
    rows = _rows_of(spec)
    if max_rows is not None and rows is not None and rows > max_rows:
        if run_candidate is not None:
            raise ValueError("run_candidate runs a kernel at the spec's full shapes; it cannot be combined with max_rows")
        return _verify_on_fewer_rows(candidate, spec, rows, max_rows, trials=trials, seed=seed, float_check=float_check,
                                     float_dtype=float_dtype)
    return Verifier(spec, trials=trials, seed=seed).verify(
        candidate, float_check=float_check, float_dtype=float_dtype, run_candidate=run_candidate
    )


def _rows_of(spec: KernelGraph) -> int | None:
    try:
        shapes = [spec.info[t].shape for t in spec.input_ids]
    except MuGraphError:
        return None
    return shapes[0][0] if shapes and shapes[0] else None


def _verify_on_fewer_rows(candidate: KernelGraph, spec: KernelGraph, rows: int, max_rows: int, **kw: Any) -> Certificate:
    from mirage_serve.verify.rows import common_group, reduced_rows, with_rows

    t0 = time.perf_counter()
    method = f"{METHOD_FIELD} {METHOD_ROWS}"
    try:
        mismatch = signature_mismatch(candidate, spec)
        candidate_hash = content_hash(candidate)
    except MuGraphError as e:
        mismatch, candidate_hash = f"candidate is not a valid μGraph: {e}", ""
    if mismatch is not None:
        cert = Certificate("not_equivalent", mismatch, method, kw["trials"], kw["seed"], spec_hash=content_hash(spec),
                           candidate_hash=candidate_hash)
        cert.elapsed_s = time.perf_counter() - t0
        return cert
    common = common_group(candidate, spec)
    n = reduced_rows(rows, common[1], max_rows) if common is not None and common[0] == rows else None
    if n is None:
        why = ("the two graphs are not both row-separable" if common is None or common[0] != rows
               else f"their row groups ({common[1]} rows) exceed it")
        cert = Certificate("unknown", f"not verified: {rows} rows exceed the {max_rows} that may be evaluated here, and {why}",
                           method, kw["trials"], kw["seed"], spec_hash=content_hash(spec), candidate_hash=candidate_hash)
        cert.elapsed_s = time.perf_counter() - t0
        return cert
    cert = Verifier(with_rows(spec, n), trials=kw["trials"], seed=kw["seed"]).verify(
        with_rows(candidate, n), float_check=kw["float_check"], float_dtype=kw["float_dtype"])
    cert.method += f" {METHOD_ROWS}"
    cert.reason += f"; verified on {n} of {rows} rows (both graphs row-separable, groups of {common[1]} rows)"
    cert.candidate_hash, cert.spec_hash = content_hash(candidate), content_hash(spec)
    cert.rows = {"rows": rows, "verified_rows": n, "group": common[1]}
    cert.elapsed_s = time.perf_counter() - t0
    return cert
