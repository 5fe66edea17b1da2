"""The token-agreement figures of benchmarks/e2e.py on hand-made logits."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench


@pytest.fixture(scope="module")
def e2e():
    return load_bench("e2e", "mirage_bench_e2e")


def _logits(tokens: torch.Tensor, vocab: int = 10, margin: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = torch.rand(*tokens.shape, vocab, generator=g)
    return base.scatter(-1, tokens[..., None], margin + 1.0)


def test_free_running_agreement_measures_the_margin_at_the_first_difference(e2e):
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    logits = _logits(ref)
    got = ref.clone()
    got[1, 2:] = torch.tensor([0, 0])  # diverges at position 2, then differs everywhere
    a = e2e.free_running_agreement(ref, logits, got)
    assert (a["equal"], a["of"], a["leading_equal_min"]) == (6, 8, 2)
    first = a["per_sequence"][1]
    assert first["leading_equal"] == 2
    assert first["ref_margin"] == pytest.approx(float(logits[1, 2, 7] - logits[1, 2, 0]))
    assert first["ref_margin_over_std"] == pytest.approx(first["ref_margin"] / float(logits[1, 2].std()))
    assert a["per_sequence"][0] == {"leading_equal": 4}


def test_forced_agreement_reports_every_disagreement_and_logit_error(e2e):
    ref = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logits = _logits(ref)
    choices = ref.clone()
    choices[0, 1] = 9
    a = e2e.forced_agreement(ref, logits, choices, logits * 1.01)
    assert (a["equal"], a["of"]) == (5, 6)
    (d,) = a["disagreements"]
    assert (d["seq"], d["pos"]) == (0, 1)
    assert d["ref_margin"] == pytest.approx(float(logits[0, 1, 2] - logits[0, 1, 9]))
    assert a["max_ref_margin_over_std"] == pytest.approx(d["ref_margin_over_std"])
    assert 0 < a["share_of_positions_with_margin_at_most_that"] <= 1
    assert a["logit_rel_error_max"] == pytest.approx(0.01, rel=1e-4)
    clean = e2e.forced_agreement(ref, logits, ref)
    assert clean["equal"] == 6 and clean["disagreements"] == [] and "max_ref_margin_over_std" not in clean
