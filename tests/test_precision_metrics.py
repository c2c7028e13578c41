"""Drift metrics against values computed by hand (float64, tolerance 1e-12 unless said)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm.precision import metrics as M

TOL = 1e-12


def lp(*rows):
    """log of explicit probability rows."""
    return torch.log(torch.tensor(rows, dtype=torch.float64))


def test_kl_two_point_distribution():
    # KL([.5,.5] || [.25,.75]) = .5 ln 2 + .5 ln(2/3)
    want = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    got = M.kl_divergence(lp([0.5, 0.5]), lp([0.25, 0.75]))
    assert got.shape == (1,)
    assert abs(float(got[0]) - want) < TOL, (float(got[0]), want)


def test_kl_is_zero_for_identical_and_ignores_logit_shift():
    logits = torch.tensor([[1.0, 2.0, -3.0], [0.5, 0.5, 4.0]], dtype=torch.float64)
    assert float(M.kl_divergence(logits, logits).abs().max()) < TOL
    # logits and logits + c are the same distribution
    assert float(M.kl_divergence(logits, logits + 7.25).abs().max()) < 1e-12
    assert M.mean_kl(logits, logits + 7.25) < 1e-12


def test_kl_zero_probability_reference_tokens_contribute_nothing():
    # p = [1, 0]: KL = 1 * ln(1 / q0) = -ln 0.8
    ref = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)
    got = float(M.kl_divergence(ref, lp([0.8, 0.2]))[0])
    assert abs(got - (-math.log(0.8))) < TOL, got


def test_kl_per_position_and_mean():
    ref = lp([0.5, 0.5], [0.9, 0.1])
    cand = lp([0.25, 0.75], [0.9, 0.1])
    per = M.kl_divergence(ref, cand)
    k0 = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert abs(float(per[0]) - k0) < TOL and abs(float(per[1])) < TOL
    assert abs(M.mean_kl(ref, cand) - k0 / 2) < TOL


def test_top1_and_same_top_p():
    ref = lp([0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8])
    cand = lp([0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.2, 0.1, 0.7])
    assert abs(M.top1_agreement(ref, cand) - 2 / 3) < TOL
    pct, err = M.same_top_p(ref, cand)
    # p = 2/3, n = 3: stderr = sqrt(p (1 - p) / (n - 1)) = 1/3
    assert abs(pct - 200 / 3) < 1e-9 and abs(err - 100 / 3) < 1e-9, (pct, err)


def test_topk_overlap_by_hand():
    ref = torch.tensor([[4.0, 3.0, 2.0, 1.0]])   # top-2 {0, 1}
    cand = torch.tensor([[1.0, 4.0, 3.0, 2.0]])  # top-2 {1, 2}
    assert abs(M.topk_overlap(ref, cand, k=2) - 0.5) < TOL
    assert abs(M.topk_overlap(ref, cand, k=4) - 1.0) < TOL
    assert abs(M.topk_overlap(ref, cand, k=1) - 0.0) < TOL
    with pytest.raises(ValueError, match="k must be"):
        M.topk_overlap(ref, cand, k=5)


def test_abs_diff():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = torch.tensor([[1.5, 2.0], [3.0, 1.0]])
    mx, mean = M.abs_diff(a, b)
    assert mx == 3.0 and abs(mean - 3.5 / 4) < TOL


def test_perplexity_by_hand():
    # uniform over 4 tokens: perplexity 4 whatever the tokens
    uni = torch.full((3, 4), math.log(0.25), dtype=torch.float64)
    assert abs(M.perplexity(uni, [0, 1, 2]) - 4.0) < 1e-12
    # next tokens get p = 0.5 then 0.25: ppl = exp(-(ln .5 + ln .25) / 2) = sqrt(8)
    rows = lp([0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25])
    ids = [3, 1, 2]  # row 0 scores token 1 (p .5), row 1 scores token 2 (p .25)
    assert abs(M.perplexity(rows, ids) - math.sqrt(8)) < 1e-12
    assert abs(M.ppl_ratio(uni, rows, ids) - math.sqrt(8) / 4) < 1e-12
    # start=1 scores only the second continuation token (p .25)
    assert abs(M.perplexity(rows, ids, start=1) - 4.0) < 1e-12
    with pytest.raises(ValueError, match="rows of log-probs"):
        M.perplexity(rows, [1, 2])


def test_greedy_agreement_and_first_divergence():
    assert M.greedy_agreement([1, 2, 3, 4], [1, 2, 5, 4]) == 0.75
    assert M.greedy_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # missing = miss
    assert M.first_divergence([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert M.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert M.first_divergence([1, 2, 3], [1, 2]) == 2
    assert M.first_divergence([9], [1]) == 0
    with pytest.raises(ValueError):
        M.greedy_agreement([], [1])


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="same shape"):
        M.top1_agreement(torch.zeros(3, 4), torch.zeros(3, 5))


def test_bootstrap_ci_constant_and_coverage():
    lo, hi = M.bootstrap_ci([[2.0, 2.0], [2.0], [2.0, 2.0, 2.0]])
    assert lo == hi == 2.0
    rng = np.random.default_rng(1)
    data = rng.normal(1.0, 1.0, size=400)
    lo, hi = M.bootstrap_ci(list(data))
    assert lo < data.mean() < hi
    # ~ mean +- 1.96 * 1 / sqrt(400) = +- 0.098
    assert 0.12 < hi - lo < 0.28, (lo, hi)
    with pytest.raises(ValueError):
        M.bootstrap_ci([], confidence=0.95)
    with pytest.raises(ValueError, match="confidence"):
        M.bootstrap_ci([1.0, 2.0], confidence=1.5)


def test_cluster_bootstrap_is_wider_than_flat_for_correlated_positions():
    # 10 sequences, each a constant (perfectly correlated positions): the flat bootstrap
    # over 1000 positions is overconfident, the cluster one is not.
    rng = np.random.default_rng(0)
    seqs = [np.full(100, v) for v in rng.normal(0, 1, size=10)]
    lo_c, hi_c = M.bootstrap_ci(seqs)
    lo_f, hi_f = M.bootstrap_ci(list(np.concatenate(seqs)))
    assert (hi_c - lo_c) > 3 * (hi_f - lo_f), ((lo_c, hi_c), (lo_f, hi_f))


def test_sequence_drift_and_summarize_by_hand():
    ref1, cand1 = lp([0.5, 0.5], [0.9, 0.1]), lp([0.25, 0.75], [0.9, 0.1])
    ref2, cand2 = lp([0.2, 0.8], [0.5, 0.5]), lp([0.2, 0.8], [0.5, 0.5])
    ids1, ids2 = [0, 1], [1, 0]
    d1 = M.sequence_drift(ref1, cand1, ids1, k=1)
    d2 = M.sequence_drift(ref2, cand2, ids2, k=1)
    k0 = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    np.testing.assert_allclose(d1.kl, [k0, 0.0], atol=TOL)
    # row 0 of seq 1: ref top-1 is a tie (0.5, 0.5) -> argmax 0; cand argmax 1
    assert list(d1.top1_same) == [False, True]
    s = M.summarize([d1, d2])
    assert s.num_sequences == 2 and s.num_positions == 4
    assert abs(s.mean_kl - k0 / 4) < TOL
    assert abs(s.top1_agreement - 0.75) < TOL
    # token log-probs: seq1 row0 scores token 1: ref .5, cand .75; seq2 row0 scores 0: .2/.2
    ppl_ref = math.exp(-(math.log(0.5) + math.log(0.2)) / 2)
    ppl_cand = math.exp(-(math.log(0.75) + math.log(0.2)) / 2)
    assert abs(s.ppl_ref - ppl_ref) < 1e-12 and abs(s.ppl_cand - ppl_cand) < 1e-12
    assert abs(s.ppl_ratio - ppl_cand / ppl_ref) < 1e-12
    assert s.kl_ci[0] <= s.mean_kl <= s.kl_ci[1]
    assert s.max_abs_diff == pytest.approx(abs(math.log(0.25) - math.log(0.5)), abs=TOL)


def test_nan_rows_are_never_perfect():
    ref = torch.log_softmax(torch.randn(3, 8, dtype=torch.float64), -1)
    bad = ref.clone()
    bad[1, 2] = float("nan")
    kl = M.kl_divergence(bad, ref)
    assert math.isnan(float(kl[1])) and float(kl[0]) == 0.0
    nan = torch.full((3, 8), float("nan"))
    assert M.top1_agreement(nan, nan) == 0.0
    assert M.same_top_p(nan, nan)[0] == 0.0
    assert M.topk_overlap(nan, nan, 2) == 0.0
    d = M.sequence_drift(bad, ref, [0, 1, 2])
    assert list(d.top1_same) == [True, False, True]


def test_bad_token_ids_and_arguments_are_rejected():
    rows = lp([0.5, 0.5], [0.5, 0.5])
    with pytest.raises(ValueError, match="integers"):
        M.perplexity(rows, [0, 1.9])
    with pytest.raises(ValueError, match="integers"):
        M.perplexity(rows, [True, 1])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        M.perplexity(rows, [0, 5])
    with pytest.raises(ValueError, match="start"):
        M.perplexity(rows, [0, 1], start=-1)
    with pytest.raises(ValueError, match="k must be"):
        M.sequence_drift(rows, rows, [0, 1], k=3)


def test_huge_perplexity_is_inf_not_an_error():
    big = torch.zeros(3, 4, dtype=torch.float64)
    big[:, 1] = 2000.0
    s = M.summarize([M.sequence_drift(big, big, [1, 0, 0], k=2)])
    assert s.ppl_ref == math.inf
