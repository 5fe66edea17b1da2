"""Adversarial pairs: identities the verifier must accept, near-misses it must reject,
and pairs outside its model, which must come out "unknown" (never "equivalent")."""

import torch

from mirage_serve.mugraph import GraphBuilder
from mirage_serve.reference import execute
from mirage_serve.verify import field_check, verify_equivalent
from mirage_serve.verify import finite_field as ff


def _graph(shapes, body, dtype="float32"):
    g = GraphBuilder()
    ins = [g.input(f"x{i}", s, dtype) for i, s in enumerate(shapes)]
    out = body(g, *ins)
    return g.build(list(out) if isinstance(out, tuple) else [out])


def _softmax(g, x):
    e = g.unary("exp", x)
    return g.binary("div", e, g.reduce("sum", e, -1))


def _verdict(cand, spec, **kw):
    return verify_equivalent(cand, spec, **kw).verdict


def test_cancellation_is_accepted_and_antisymmetry_rejected():
    s = [(4, 8), (4, 8)]
    a = _graph(s, lambda g, a, b: a)
    assert _verdict(_graph(s, lambda g, a, b: g.binary("sub", g.binary("add", a, b), b)), a) == "equivalent"
    a_minus_b = _graph(s, lambda g, a, b: g.binary("sub", a, b))
    b_minus_a = _graph(s, lambda g, a, b: g.binary("sub", b, a))
    cert = verify_equivalent(b_minus_a, a_minus_b)
    assert cert.verdict == "not_equivalent" and "output 0 differs at 32 of 32" in cert.reason


def test_polynomial_vanishing_on_01_inputs_is_rejected():
    s = [(64,)]
    zero = _graph(s, lambda g, x: g.binary("sub", x, x))
    x_xm1 = _graph(s, lambda g, x: g.binary("mul", x, g.unary("add_scalar", x, scalar=-1.0)))
    # agrees with 0 on every {0,1}-valued input: a fingerprint on such inputs would accept it
    bits = (torch.arange(64) % 2).double()
    assert torch.equal(execute(x_xm1, [bits])[0], execute(zero, [bits])[0])
    for seed in range(5):
        assert _verdict(x_xm1, zero, seed=seed) == "not_equivalent"


def test_exact_small_constants_keep_ring_identities():
    s = [(3, 5)]
    twice = _graph(s, lambda g, x: g.binary("add", x, x))
    assert _verdict(_graph(s, lambda g, x: g.unary("mul_scalar", x, scalar=2.0)), twice) == "equivalent"
    quarter = _graph(s, lambda g, x: g.unary("mul_scalar", x, scalar=0.25))
    halves = _graph(s, lambda g, x: g.unary("mul_scalar", g.unary("mul_scalar", x, scalar=0.5), scalar=0.5))
    assert _verdict(halves, quarter) == "equivalent"
    mean = _graph(s, lambda g, x: g.unary("mul_scalar", g.reduce("sum", x, -1), scalar=1 / 5))

    def over_count(g, x):  # sum(x) / sum(ones): the count as a field element
        ones = g.unary("add_scalar", g.binary("sub", x, x), scalar=1.0)
        return g.binary("div", g.reduce("sum", x, -1), g.reduce("sum", ones, -1))

    assert _verdict(_graph(s, over_count), mean) == "equivalent"


def test_exp_homomorphism_is_accepted():
    s = [(4, 8), (4, 8)]
    lhs = _graph(s, lambda g, a, b: g.unary("exp", g.binary("add", a, b)))
    rhs = _graph(s, lambda g, a, b: g.binary("mul", g.unary("exp", a), g.unary("exp", b)))
    assert _verdict(lhs, rhs) == "equivalent"
    wrong = _graph(s, lambda g, a, b: g.binary("add", g.unary("exp", a), g.unary("exp", b)))
    assert _verdict(wrong, rhs) == "not_equivalent"


def test_softmax_shift_invariance_accepted_when_it_holds():
    s = [(4, 16)]
    plain = _graph(s, _softmax)
    shifted = _graph(s, lambda g, x: _softmax(g, g.binary("sub", x, g.reduce("sum", x, -1))))
    assert _verdict(shifted, plain) == "equivalent"
    with_max = _graph(s, lambda g, x: _softmax(g, g.binary("sub", x, g.reduce("max", x, -1))))
    assert _verdict(with_max, plain) == "equivalent"
    assert _verdict(plain, with_max) == "equivalent"


def test_logits_off_by_a_shift_only_on_special_inputs_are_rejected():
    # upstream's qknorm_gqa failure mode: the wrong logits Q@K + Q[:, :1] @ K[:1, :] differ from
    # Q@K by a per-row constant whenever K's first row is constant (as with index-valued inputs),
    # and softmax hides that constant; uniformly random inputs expose it.
    shapes = [(8, 4), (4, 32), (1, 4), (4, 1)]

    def attn(g, q, k, sel_col, sel_row, wrong):
        logits = g.matmul(q, k)
        if wrong:
            logits = g.binary("add", logits, g.matmul(g.matmul(q, sel_col), g.matmul(sel_row, k)))
        return _softmax(g, logits)

    # sel_col picks column 0 of Q (as [4,1] with a one), sel_row picks row 0 of K: inputs of the graph
    spec = _graph(shapes, lambda g, q, k, a, b: attn(g, q, k, b, a, False))
    wrong = _graph(shapes, lambda g, q, k, a, b: attn(g, q, k, b, a, True))
    q, k = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 32, dtype=torch.float64)
    k[0] = 0.7
    pick = [torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64), torch.tensor([[1.0], [0], [0], [0]], dtype=torch.float64)]
    a, b = execute(spec, [q, k, *pick])[0], execute(wrong, [q, k, *pick])[0]
    assert float((a - b).abs().max()) < 1e-12  # indistinguishable on this input
    for seed in range(5):
        assert field_check(wrong, spec, seed=seed).verdict == "not_equivalent"


def test_spec_depending_on_max_is_unknown():
    s = [(4, 16)]
    rowmax = _graph(s, lambda g, x: g.reduce("max", x, -1))
    cert = verify_equivalent(rowmax, rowmax)
    assert cert.verdict == "unknown" and "depends on the values max returns" in cert.reason


def test_candidate_depending_on_max_is_unknown_not_equivalent():
    s = [(4, 16)]
    spec = _graph(s, _softmax)

    def two_maxima(g, x):  # correct over the reals, but uses two separate max computations
        e1 = g.unary("exp", g.binary("sub", x, g.reduce("max", x, -1)))
        e2 = g.unary("exp", g.binary("sub", x, g.reduce("max", x, -1)))
        return g.binary("div", e1, g.reduce("sum", e2, -1))

    res = field_check(_graph(s, two_maxima), spec)
    assert res.verdict == "unknown" and "depends on the values max returns" in res.reason

    def unshifted_denominator(g, x):  # wrong: the numerator is shifted, the denominator is not
        e = g.unary("exp", g.binary("sub", x, g.reduce("max", x, -1)))
        return g.binary("div", e, g.reduce("sum", g.unary("exp", x), -1))

    assert field_check(_graph(s, unshifted_denominator), spec).verdict == "unknown"


def test_exp_of_exp_is_unknown():
    s = [(4, 4)]
    ee = _graph(s, lambda g, x: g.unary("exp", g.unary("exp", x)))
    cert = verify_equivalent(ee, ee)
    assert cert.verdict == "unknown" and "exp of an exp" in cert.reason


def test_facts_about_uninterpreted_functions_are_not_assumed():
    # sqrt(x)^2 = x for x >= 0 over the reals, but sqrt is a random function here:
    # a documented incompleteness (never a false "equivalent")
    s = [(4, 4)]
    x = _graph(s, lambda g, x: x)
    sq = _graph(s, lambda g, x: g.unary("square", g.unary("sqrt", x)))
    assert field_check(sq, x).verdict == "not_equivalent"
    rs = _graph(s, lambda g, x: g.unary("rsqrt", x))
    assert field_check(_graph(s, lambda g, x: g.unary("recip", g.unary("sqrt", x))), rs).verdict == "equivalent"


def test_signature_mismatches_are_not_equivalent():
    a = _graph([(4, 8)], lambda g, x: x)
    assert "output 0" in verify_equivalent(_graph([(4, 8)], lambda g, x: g.reduce("sum", x, -1)), a).reason
    assert "input 0" in verify_equivalent(_graph([(8, 4)], lambda g, x: x), a).reason
    assert "float16" in verify_equivalent(_graph([(4, 8)], lambda g, x: x, dtype="float16"), a).reason
    two = _graph([(4, 8)], lambda g, x: (x, x))
    cert = verify_equivalent(two, a)
    assert cert.verdict == "not_equivalent" and "2 outputs" in cert.reason
    # outputs are matched in order
    swapped = _graph([(4, 8), (4, 8)], lambda g, x, y: (y, x))
    assert _verdict(swapped, _graph([(4, 8), (4, 8)], lambda g, x, y: (x, y))) == "not_equivalent"


def test_division_by_zero_is_never_silent():
    s = [(4, 4), (4, 4)]
    always_zero = _graph(s, lambda g, x, y: g.binary("div", x, g.binary("sub", y, y)))
    cert = verify_equivalent(always_zero, always_zero)
    assert cert.verdict == "unknown" and "divided by zero" in cert.reason and cert.redraws == 9
    # the float reference is infinite too: the float check decides nothing either
    assert not cert.float_checks[0].conclusive and "cannot decide" in cert.reason


def test_zero_denominators_are_redrawn_and_counted(monkeypatch):
    # with tiny safe primes a random denominator is often 0 mod p: the trial is redrawn
    monkeypatch.setattr(ff, "safe_primes", lambda: (23, 47, 59, 83, 107))
    s = [(4, 4), (4, 4)]
    div = _graph(s, lambda g, x, y: g.binary("div", x, y))
    recip = _graph(s, lambda g, x, y: g.binary("mul", x, g.unary("recip", y)))
    total = 0
    for seed in range(4):
        res = ff.FieldVerifier(div, trials=3, seed=seed, max_redraws=200).check(recip)
        assert res.verdict == "equivalent"
        total += res.redraws
    assert total > 0
