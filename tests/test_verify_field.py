"""The modular algebra under the finite-field verifier: exactness and the handling of
operations outside the algebra."""

import random

import pytest
import torch

from mirage_serve.verify.field import (
    FieldAlgebra,
    FieldValue,
    TrialContext,
    Undecidable,
    ZeroDenominator,
    _exact_rational,
    matmul_mod,
    powmod,
    safe_primes,
)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def test_safe_primes_are_safe_and_below_2_20():
    ps = safe_primes()
    assert len(ps) > 1000
    rng = random.Random(0)
    for p in rng.sample(ps, 20) + [ps[0], ps[-1]]:
        assert (1 << 19) <= p < (1 << 20)
        assert _is_prime(p) and _is_prime((p - 1) // 2)


def test_remainder_is_exact_for_integers_below_2_53():
    # the algebra relies on float64 remainder being exact for exact integers < 2^53
    g = torch.Generator().manual_seed(0)
    for m in (safe_primes()[0], safe_primes()[-1], (safe_primes()[-1] - 1) // 2):
        k = torch.randint(0, (1 << 53) // m, (200_000,), generator=g)
        x = torch.cat([k * m, k * m - 1, k * m + 1, k * m + m - 1, torch.randint(0, 1 << 53, (200_000,), generator=g)])
        x = x[(x >= 0) & (x < (1 << 53))]
        assert torch.equal(torch.remainder(x.double(), float(m)).long(), x % m)


def test_matmul_mod_exact_with_chunked_inner_dim():
    p = safe_primes()[-1]
    g = torch.Generator().manual_seed(1)
    a = torch.randint(p - 50, p, (3, 20000), generator=g, dtype=torch.float64)  # worst case: residues near p
    b = torch.randint(p - 50, p, (20000, 2), generator=g, dtype=torch.float64)
    got = matmul_mod(a, b, p).long()
    ai, bi = a.long().tolist(), b.long().tolist()
    for i in range(3):
        for j in range(2):
            assert got[i, j] == sum(ai[i][k] * bi[k][j] for k in range(20000)) % p


def test_powmod_and_inverse():
    p = safe_primes()[5]
    x = torch.tensor([1.0, 2.0, 12345.0, float(p - 1)], dtype=torch.float64)
    inv = powmod(x, p - 2, p)
    assert torch.equal(torch.remainder(x * inv, p), torch.ones(4, dtype=torch.float64))


def _alg(track_q=True, seed=3):
    ctx = TrialContext.draw(safe_primes()[-7], seed, track_q)
    return ctx, FieldAlgebra(ctx, max_seed=seed + 1)


def _val(ctx, xs):
    t = torch.tensor(xs, dtype=torch.int64)
    return FieldValue(torch.remainder(t, ctx.p).double(), torch.remainder(t, ctx.q).double())


def test_omega_has_order_q_and_exp_is_a_homomorphism():
    ctx, alg = _alg()
    assert ctx.omega != 1 and pow(ctx.omega, ctx.q, ctx.p) == 1
    a, b = _val(ctx, [5, 77, 123456]), _val(ctx, [9, 1000, 3])
    lhs = alg.unary("exp", alg.binary("add", a, b))
    rhs = alg.binary("mul", alg.unary("exp", a), alg.unary("exp", b))
    assert torch.equal(lhs.p, rhs.p)
    quot = alg.binary("div", alg.unary("exp", a), alg.unary("exp", b))
    assert torch.equal(quot.p, alg.unary("exp", alg.binary("sub", a, b)).p)
    assert [int(v) for v in alg.unary("exp", a).p] == [pow(ctx.omega, int(x) % ctx.q, ctx.p) for x in (5, 77, 123456)]


def test_exp_of_exp_is_undecidable():
    ctx, alg = _alg()
    e = alg.unary("exp", _val(ctx, [1, 2]))
    assert e.q is None
    with pytest.raises(Undecidable):
        alg.unary("exp", e)


def test_zero_denominator_redraws_and_zero_mod_q_only_drops_exponent():
    ctx, alg = _alg()
    with pytest.raises(ZeroDenominator):
        alg.binary("div", _val(ctx, [1, 2]), _val(ctx, [3, 0]))
    with pytest.raises(ZeroDenominator):
        alg.unary("recip", _val(ctx, [ctx.p]))
    r = alg.unary("recip", _val(ctx, [ctx.q]))  # nonzero mod p, zero mod q
    assert r.q is None and "zero mod q" in r.why
    assert int(r.p[0]) * ctx.q % ctx.p == 1


def test_random_functions_are_shared_and_rsqrt_is_one_over_sqrt():
    ctx, alg = _alg()
    x = _val(ctx, [0, 4, 9, 4])
    s1, s2 = alg.unary("sqrt", x), FieldAlgebra(ctx, max_seed=99).unary("sqrt", x)
    assert torch.equal(s1.p, s2.p) and s1.p[1] == s1.p[3] and bool((s1.p != 0).all())
    assert torch.equal(alg.binary("mul", alg.unary("rsqrt", x), s1).p, torch.ones(4, dtype=torch.float64))
    assert not torch.equal(alg.unary("silu", x).p, s1.p)


def test_float_constants_keyed_by_exact_value():
    ctx, _ = _alg()
    assert ctx.constant(0.0) == (0, 0) and ctx.constant(1.0) == (1, 1)
    assert ctx.constant(-1.0) == (ctx.p - 1, ctx.q - 1)
    half = ctx.constant(0.5)[0]
    assert half * 2 % ctx.p == 1
    assert ctx.constant(1 / 4096)[0] * 4096 % ctx.p == 1
    assert ctx.constant(1e-6) == ctx.constant(1e-6)
    assert ctx.constant(1e-6) != ctx.constant(1e-5)
    other = TrialContext.draw(ctx.p, seed=ctx.seed + 1)
    assert other.constant(1e-6) != ctx.constant(1e-6)  # random per trial
    assert _exact_rational(1e-6) is None and _exact_rational(1 / 3) == (1, 3) and _exact_rational(2.0**24) == (1 << 24, 1)
    with pytest.raises(ValueError, match="not finite"):
        ctx.constant(float("inf"))


def test_max_returns_fresh_values_and_is_counted():
    ctx, alg = _alg()
    x = _val(ctx, [[1, 2, 3], [4, 5, 6]])
    m1, m2 = alg.max(x, -1), alg.max(x, -1)
    assert m1.shape == (2, 1) and alg.max_calls == 2
    assert not torch.equal(m1.p, m2.p)
    assert alg.max(x, 0, keepdim=False).shape == (3,)


def test_untracked_exponents_skip_q_components():
    ctx, alg = _alg(track_q=False)
    x = alg.lift(torch.tensor([[3, 4]]))
    y = alg.matmul(x, alg.lift(torch.tensor([[1], [2]])))
    assert y.q is None and int(y.p[0, 0]) == 11
    with pytest.raises(RuntimeError, match="does not track"):
        alg.unary("exp", y)


def test_rms_norm_matches_its_definition():
    ctx, alg = _alg()
    x = _val(ctx, [[1, 2, 3, 4]])
    got = alg.rms_norm(x, None, 1e-6)
    ms = alg.scale_by_count(alg.sum(alg.binary("mul", x, x), -1), 4)
    want = alg.binary("div", x, alg.unary("sqrt", alg.unary("add_scalar", ms, 1e-6)))
    assert torch.equal(got.p, want.p)
