"""Certificates, the float check and verify_equivalent's combination of both."""

import time

import pytest
import torch
from handwritten import fused_rmsnorm_linear

from mirage_serve.mugraph import GraphBuilder
from mirage_serve.specs import build_spec
from mirage_serve.verify import TOLERANCES, Certificate, FloatReport, float_check, verify_equivalent


def _small():
    spec = build_spec("rmsnorm_linear", {"batch": 4, "hidden": 64, "out": 48})
    return fused_rmsnorm_linear(4, 64, 48, 6, 4), spec


def test_certificate_round_trips_and_records_the_draws():
    cand, spec = _small()
    cert = verify_equivalent(cand, spec, trials=3, seed=7)
    assert cert.verdict == "equivalent"
    assert len(cert.primes) == len(set(cert.primes)) == 3 and len(cert.omegas) == 3
    assert all(pow(w, (p - 1) // 2, p) == 1 and w != 1 for p, w in zip(cert.primes, cert.omegas))
    (fr,) = cert.float_checks
    assert fr.dtype == "float32" and fr.passed and fr.rel_error < fr.tolerance == TOLERANCES["float32"]
    assert cert.versions["torch"] == torch.__version__ and cert.elapsed_s > 0
    assert Certificate.from_dict(cert.to_dict()) == cert


def test_from_dict_is_strict():
    cand, spec = _small()
    d = verify_equivalent(cand, spec, float_check=False).to_dict()
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        Certificate.from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="missing \\['seed'\\]"):
        Certificate.from_dict({k: v for k, v in d.items() if k != "seed"})
    with pytest.raises(ValueError, match="'trials'"):
        Certificate.from_dict({**d, "trials": "3"})
    with pytest.raises(ValueError, match="verdict"):
        Certificate.from_dict({**d, "verdict": "probably"})
    fr = FloatReport("float16", 0, 1.0, 0.1, 0.001, 0.004, True).to_dict()
    assert FloatReport.from_dict(fr) == FloatReport("float16", 0, 1.0, 0.1, 0.001, 0.004, True)
    with pytest.raises(ValueError, match="keys"):
        Certificate.from_dict({**d, "float_checks": [{**fr, "note": "x"}]})


def test_deterministic_for_a_seed():
    cand, spec = _small()
    a, b = (verify_equivalent(cand, spec, seed=11).to_dict() for _ in range(2))
    a.pop("elapsed_s"), b.pop("elapsed_s")
    assert a == b
    assert verify_equivalent(cand, spec, seed=12).primes != a["primes"]


def test_float_failure_after_field_pass_is_not_equivalent():
    # x * 2^-24 * 2^24 is x exactly in the field (both constants map exactly) but
    # underflows in float16
    g = GraphBuilder()
    x = g.input("X", (8, 32), "float16")
    ident = g.build([x])
    g = GraphBuilder()
    x = g.input("X", (8, 32), "float16")
    lossy = g.build([g.unary("mul_scalar", g.unary("mul_scalar", x, scalar=2.0**-24), scalar=2.0**24)])
    cert = verify_equivalent(lossy, ident)
    assert cert.verdict == "not_equivalent"
    assert "finite-field trials agree, but the float check fails" in cert.reason
    assert len(cert.primes) == 3 and not cert.float_checks[0].passed
    assert verify_equivalent(lossy, ident, float_check=False).verdict == "equivalent"


def test_float_check_with_a_callable_candidate():
    cand, spec = _small()

    def right(ins):
        x, gn, w = ins
        return [(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gn) @ w.T]

    def noisy(ins):
        (y,) = right(ins)
        return [y + 1e-3 * y.abs().max()]

    assert float_check(cand, spec, run_candidate=right, seed=3).passed
    bad = float_check(cand, spec, run_candidate=noisy, seed=3)
    assert not bad.passed and bad.rel_error > bad.tolerance and "exceeds" in bad.reason
    assert verify_equivalent(cand, spec, run_candidate=noisy).verdict == "not_equivalent"
    broken = float_check(cand, spec, run_candidate=lambda ins: [ins[0][:, :48] * float("nan")])
    assert not broken.passed and "non-finite" in broken.reason


def test_float_check_precisions_and_scale():
    for dtype in ("float16", "bfloat16"):
        spec = build_spec("attention_decode", {"batch": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "kv_len": 64}, dtype=dtype)
        r = float_check(spec, spec, seed=1)
        assert r.passed and 0 < r.rel_error < TOLERANCES[dtype] and r.scale == 1.0
    # exp(Q @ K) without max-subtraction: the scale shrinks until exp stays small
    spec = build_spec("mirage_gqa", {"heads": 1, "q_len": 8, "head_dim": 64, "kv_len": 256})
    r = float_check(spec, spec)
    assert r.passed and r.scale < 1.0


def test_llama3_8b_rmsnorm_linear_under_10s(capsys):
    # batch 16, hidden 4096 -> 6144 (Llama-3-8B's fused QKV), the hand-written fused μGraph
    spec = build_spec("rmsnorm_linear", {"batch": 16, "hidden": 4096, "out": 6144})
    cand = fused_rmsnorm_linear(16, 4096, 6144, n_blocks=48, loop=4)
    t0 = time.perf_counter()
    cert = verify_equivalent(cand, spec)
    elapsed = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nverify rmsnorm_linear 16x4096->6144 (3 trials + float32 check): {elapsed:.2f}s "
              f"(certificate elapsed {cert.elapsed_s:.2f}s), rel error {cert.float_checks[0].rel_error:.2g}")
    assert cert.verdict == "equivalent", cert.reason
    assert elapsed < 20.0  # < 10 s on an idle 2-core machine; margin for a shared one


def test_inputs_are_drawn_once_per_trial_and_the_scale_run_is_the_reference(monkeypatch):
    """Large inputs are not kept between candidates, but within one trial the candidate runs on the
    draw the spec ran on; the float reference is the float64 run that chose the scale."""
    import mirage_serve.verify.finite_field as ff
    from mirage_serve.reference import execute
    from mirage_serve.verify.float_check import choose_scale, float_inputs, float_reference

    cand, spec = _small()
    draws = []
    real = ff._draw_inputs
    monkeypatch.setattr(ff, "_draw_inputs", lambda g, ctx: draws.append(g) or real(g, ctx))
    monkeypatch.setattr(ff, "INPUT_CACHE_BYTES", 0)
    verifier = ff.FieldVerifier(spec, trials=3, seed=1)
    assert verifier.check(cand).verdict == "equivalent"
    assert draws == [spec] * 3  # one draw per trial, shared by the spec and the candidate
    assert verifier.check(cand).verdict == "equivalent"
    assert draws[3:] == [cand] * 3  # the spec's runs are cached, their large inputs are not

    ref = float_reference(spec, dtype="bfloat16", seed=5)
    scale = choose_scale(spec, 5, "bfloat16")
    ins = float_inputs(spec, 5, scale, "bfloat16")
    assert ref.scale == scale and all(torch.equal(a, b) for a, b in zip(ref.inputs, ins, strict=True))
    again = execute(spec, [x.to(torch.float64) for x in ins])
    assert all(torch.equal(a, b) for a, b in zip(ref.outputs, again, strict=True))
