"""The sampler against independent NumPy references on small handmade vocabularies.

Reference definitions (vLLM v1, ``vllm/v1/sample``), all in float64 here:

* raw log-probs: ``log_softmax(logits)`` before anything else touches the logits;
* min_tokens: blocked ids (EOS / stop ids) get -inf;
* repetition penalty (CTRL): for ids in prompt or output, ``l / r`` if ``l > 0`` else
  ``l * r``; then frequency ``l -= f * count_in_output`` and presence
  ``l -= p * (count_in_output > 0)`` (OpenAI);
* greedy: argmax (lowest id on ties);
* random: ``p = softmax(l / T)``; min_p keeps ``p >= min_p * max(p)``; top_k keeps the
  k largest (ties with the k-th kept); then the distribution is renormalised over what
  is left and top_p keeps, in descending order, every token whose strictly-better mass
  is ``< top_p``; the result is sampled from the renormalised kept mass.

Distribution checks draw N samples (seeded, so every run is identical) and apply two
tests: Pearson's chi-square against the reference with a critical value at p ~ 1e-6
(Wilson-Hilferty approximation; no scipy here), and a per-token bound
``|freq - p| <= 5 * sqrt(p (1 - p) / N) + 1/N`` (5 sigma per token; over <= 50 tokens
a correct sampler fails with probability < 50 * 5.7e-7 ~ 3e-5). Every such test also
asserts that the plausible wrong answer (wrong order, no temperature, ...) sits far
outside these bounds, so the check has the power to catch it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm.layers.sampler import (Sampler, SamplingMetadata, apply_min_p, apply_penalties,
                                     apply_top_k_top_p)

N_SAMPLES = 20_000


# --- references ---------------------------------------------------------------------

def ref_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    z = x[finite] - x[finite].max()
    e = np.exp(z)
    out[finite] = e / e.sum()
    return out


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def ref_truncate(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Allowed-token mask and the renormalised distribution, in vLLM v1's order."""
    p = ref_softmax(np.asarray(logits, np.float64) / temperature)
    keep = np.ones(len(p), dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0 and top_k < keep.sum():
        kth = np.sort(p[keep])[::-1][top_k - 1]
        keep &= p >= kth
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q = q / q.sum()
        better_mass = np.array([q[q > q[i]].sum() for i in range(len(q))])
        keep &= better_mass < top_p
    dist = np.where(keep, p, 0.0)
    return keep, dist / dist.sum()


def ref_top_p_margin(logits, temperature, top_k, top_p, min_p) -> float:
    """How far the closest token is from the top_p boundary (precondition for the test data)."""
    p = ref_softmax(np.asarray(logits, np.float64) / temperature)
    keep = np.ones(len(p), dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0 and top_k < keep.sum():
        keep &= p >= np.sort(p[keep])[::-1][top_k - 1]
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    better = np.array([q[q > q[i]].sum() for i in range(len(q))])
    return float(np.min(np.abs(better[keep] - top_p)))


def ref_penalties(logits, prompt, output, rep=1.0, freq=0.0, pres=0.0):
    out = np.asarray(logits, dtype=np.float64).copy()
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(out)) \
        if output else np.zeros(len(out), np.int64)
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    out -= freq * counts
    out -= pres * (counts > 0)
    return out


# --- statistics ---------------------------------------------------------------------

def chi2_critical(df: int, z: float = 4.75) -> float:
    """Chi-square quantile at upper tail ~1e-6 (z = 4.75), Wilson-Hilferty."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray, p_ref: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    expected = n * p_ref
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e >= 5:
        obs.append(rest_o)
        exp.append(rest_e)
    obs, exp = np.array(obs, np.float64), np.array(exp, np.float64)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def token_bound(p_ref: np.ndarray, n: int) -> np.ndarray:
    return 5.0 * np.sqrt(p_ref * (1.0 - p_ref) / n) + 1.0 / n


def assert_distribution(samples, p_ref, label, wrong=None):
    """samples follow p_ref; `wrong` (if given) is a distribution the test must reject."""
    samples = np.asarray(samples)
    V = len(p_ref)
    counts = np.bincount(samples, minlength=V)
    n = int(counts.sum())
    assert len(counts) == V, f"{label}: sampled id >= V"
    outside = np.flatnonzero((p_ref == 0) & (counts > 0))
    assert outside.size == 0, f"{label}: sampled disallowed tokens {outside.tolist()}"
    freq = counts / n
    stat, df = chi2_stat(counts, p_ref)
    crit = chi2_critical(df)
    max_dev = float(np.max(np.abs(freq - p_ref) - token_bound(p_ref, n)))
    print(f"{label}: N={n} chi2={stat:.1f} (df={df}, crit={crit:.1f}), "
          f"max|freq-p|={np.abs(freq - p_ref).max():.4f}")
    assert stat < crit, f"{label}: chi2 {stat:.1f} >= {crit:.1f}"
    assert max_dev <= 0, f"{label}: a token frequency is outside its 5-sigma bound by {max_dev:.4f}"
    if wrong is not None:
        # Power check: the wrong distribution, at its expected counts, fails both tests.
        excess = np.max(np.abs(wrong - p_ref) - token_bound(p_ref, n))
        assert excess > 0, f"{label}: test data cannot tell the wrong answer apart"
        wrong_stat, _ = chi2_stat(np.round(wrong * n).astype(np.int64), p_ref)
        assert wrong_stat > 3 * crit, f"{label}: wrong answer chi2 {wrong_stat:.1f} too small"


# --- helpers ------------------------------------------------------------------------

def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_meta(B: int, temperature=1.0, top_k=None, top_p=None, min_p=None, **kw) -> SamplingMetadata:
    def vec(v, dtype=torch.float32):
        if v is None:
            return None
        if isinstance(v, (list, tuple)):
            return torch.tensor(v, dtype=dtype)
        return torch.full((B,), v, dtype=dtype)

    return SamplingMetadata(temperature=vec(temperature), top_k=vec(top_k, torch.int64),
                            top_p=vec(top_p), min_p=vec(min_p), **kw)


def sample_many(logits_row, n=N_SAMPLES, seed=0, **params) -> np.ndarray:
    """n independent draws for one row: the row repeated n times in one batch."""
    row = torch.tensor(np.asarray(logits_row), dtype=torch.float32)
    logits = row.expand(n, row.numel()).contiguous()
    meta = make_meta(n, **params)
    out = Sampler(gen(seed))(logits, meta)
    return out.sampled.numpy()


def masked(t: torch.Tensor) -> np.ndarray:
    return ~torch.isinf(t).numpy()


# Handmade logits, deliberately not sorted by id, so scatter/gather bugs show.
L10 = np.array([0.3, 2.0, -1.0, 1.2, -3.0, 1.5, 0.0, -0.4, 0.9, -2.0])
RNG = np.random.default_rng(1234)
L24 = np.round(RNG.normal(0.0, 1.5, size=24), 3)
L50 = np.round(RNG.normal(0.0, 1.0, size=50), 3)


# --- truncation masks against the reference -------------------------------------------

TRUNC_CASES = [
    # (logits, temperature, top_k, top_p, min_p)
    (L10, 1.0, 1, 1.0, 0.0),
    (L10, 1.0, 3, 1.0, 0.0),
    (L10, 1.0, 9, 1.0, 0.0),
    (L10, 1.0, 10, 1.0, 0.0),
    (L10, 1.0, 50, 1.0, 0.0),   # k > V: no-op
    (L10, 1.0, -1, 0.5, 0.0),
    (L10, 1.0, -1, 0.8, 0.0),
    (L10, 0.7, -1, 0.95, 0.0),
    (L10, 1.0, 0, 0.01, 0.0),   # only the most likely token survives
    (L10, 1.0, -1, 1.0, 0.1),
    (L10, 1.0, -1, 1.0, 0.5),
    (L10, 2.0, -1, 1.0, 0.3),   # min_p on the temperature-scaled distribution
    (L10, 1.0, -1, 1.0, 1.0),   # only the max
    (L24, 1.0, 5, 1.0, 0.0),
    (L24, 1.3, -1, 0.6, 0.0),
    (L24, 0.8, -1, 1.0, 0.05),
    (L24, 1.0, 8, 0.7, 0.02),
    (L50, 1.0, 20, 0.9, 0.11),
    (L50, 0.5, 12, 0.75, 0.0),
    (L50, 1.5, -1, 0.85, 0.15),
]


def _apply_pipeline(logits_np, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The sampler's own truncation helpers, in the order Sampler calls them."""
    x = torch.tensor(logits_np, dtype=torch.float32)[None] / temperature
    x = apply_min_p(x, torch.tensor([min_p], dtype=torch.float32))
    x = apply_top_k_top_p(x, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float32))
    return masked(x[0])


@pytest.mark.parametrize("case", TRUNC_CASES, ids=lambda c: f"V{len(c[0])}-T{c[1]}-k{c[2]}-p{c[3]}-minp{c[4]}")
def test_truncation_mask_matches_reference(case):
    logits, T, k, p, mp = case
    if p < 1.0:
        assert ref_top_p_margin(logits, T, k, p, mp) > 1e-4, "test data too close to the boundary"
    if mp > 0:
        probs = ref_softmax(np.asarray(logits) / T)
        rel = probs / probs.max()
        assert np.min(np.abs(rel[rel != 1.0] - mp)) > 1e-4, "test data too close to min_p"
    keep, _ = ref_truncate(logits, T, k, p, mp)
    got = _apply_pipeline(logits, T, k, p, mp)
    np.testing.assert_array_equal(got, keep)


def test_top_k_keeps_ties_at_kth_and_all_rows_independent():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    top_k = torch.tensor([2, 3, -1, 1])
    got = masked(apply_top_k_top_p(logits, top_k, None))
    expect = np.array([[1, 1, 1, 1, 0, 0],   # 3 and all three tied 2's
                       [0, 0, 0, 1, 1, 1],
                       [1, 1, 1, 1, 1, 1],   # -1 disables
                       [1, 1, 1, 1, 1, 1]],  # all tie with the 1st
                      dtype=bool)
    np.testing.assert_array_equal(got, expect)


def test_batch_mixes_per_row_truncation_and_disabled_rows():
    """One batch, a different setting per row, including rows where everything is off
    (top_k=-1 / 0, top_p=1, min_p=0) next to rows that use each knob."""
    rows = [
        (L24, 1.0, -1, 1.0, 0.0),
        (L24, 1.0, 5, 1.0, 0.0),
        (L24, 1.3, -1, 0.6, 0.0),
        (L24, 0.8, -1, 1.0, 0.05),
        (L24, 1.0, 0, 1.0, 0.0),
        (L24[::-1].copy(), 1.0, 8, 0.7, 0.02),
    ]
    x = torch.tensor(np.stack([r[0] for r in rows]), dtype=torch.float32)
    x = x / torch.tensor([r[1] for r in rows])[:, None]
    x = apply_min_p(x, torch.tensor([r[4] for r in rows], dtype=torch.float32))
    x = apply_top_k_top_p(x, torch.tensor([r[2] for r in rows]),
                          torch.tensor([r[3] for r in rows], dtype=torch.float32))
    for i, (lg, T, k, p, mp) in enumerate(rows):
        keep, _ = ref_truncate(lg, T, k, p, mp)
        np.testing.assert_array_equal(masked(x[i]), keep, err_msg=f"row {i}")


def test_top_p_one_disables_even_when_cumsum_rounds_to_one():
    """A row with top_p=1.0 batched next to a row with top_p<1 must keep every token with
    non-zero probability: in float32 the head's cumulative mass can round to exactly 1.0
    while the tail still has positive probability (here ~1e-13)."""
    lg = np.array([0.0] + [-30.0] * 7)
    x = torch.tensor(np.stack([lg, lg]), dtype=torch.float32)
    probs = torch.softmax(x, -1)
    assert float(probs[0, 0]) == 1.0 and float(probs[0, 1]) > 0  # the float32 situation
    got = masked(apply_top_k_top_p(x, None, torch.tensor([1.0, 0.5])))
    assert got[0].all(), f"top_p=1.0 dropped tokens {np.flatnonzero(~got[0]).tolist()}"
    np.testing.assert_array_equal(got[1], [True] + [False] * 7)


ORDER_PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005])
ORDER_PERM = np.array([4, 7, 0, 9, 2, 5, 1, 8, 3, 6])  # ids not in probability order


def _renorm_top_p(probs, keep, top_p):
    q = np.where(keep, probs, 0.0)
    q = q / q.sum()
    better = np.array([q[q > q[i]].sum() for i in range(len(q))])
    return keep & (better < top_p)


@pytest.mark.parametrize("min_p,top_k,top_p,n_keep,n_wrong", [
    (0.35, 6, 0.6, 2, 3),   # min_p cuts deeper than top_k: top_p must see min_p's cut
    (0.12, 4, 0.7, 3, 4),   # top_k cuts deeper than min_p: top_p must see top_k's cut
])
def test_order_min_p_then_top_k_then_top_p(min_p, top_k, top_p, n_keep, n_wrong):
    """min_p and top_k shrink the set first, then top_p works on the renormalised rest
    (vLLM v1). The data is chosen so that every other order gives a different set."""
    probs = ORDER_PROBS[ORDER_PERM]
    lg = np.log(probs)
    keep, dist = ref_truncate(lg, 1.0, top_k, top_p, min_p)
    assert keep.sum() == n_keep
    assert ref_top_p_margin(lg, 1.0, top_k, top_p, min_p) > 1e-2
    # the wrong orders, for the power check
    by_min_p = probs >= min_p * probs.max()
    by_top_k = probs >= np.sort(probs)[::-1][top_k - 1]
    everything = np.ones(len(probs), bool)
    wrong_sets = {
        "top_p on the raw distribution": _renorm_top_p(probs, everything, top_p) & by_min_p & by_top_k,
        "top_p after top_k, before min_p": _renorm_top_p(probs, by_top_k, top_p) & by_min_p,
        "top_p after min_p, before top_k": _renorm_top_p(probs, by_min_p, top_p) & by_top_k,
    }
    wrong_sets = {k: v for k, v in wrong_sets.items() if not np.array_equal(v, keep)}
    assert any(v.sum() == n_wrong for v in wrong_sets.values())
    np.testing.assert_array_equal(_apply_pipeline(lg, 1.0, top_k, top_p, min_p), keep)

    # end to end through Sampler: support and frequencies
    s = sample_many(lg, seed=7, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    for name, w in wrong_sets.items():
        wrong = np.where(w, probs, 0.0) / np.where(w, probs, 0.0).sum()
        assert_distribution(s, dist, f"order vs {name}", wrong=wrong)


# --- sampled frequencies against the reference distribution ----------------------------

DIST_CASES = [
    # (logits, temperature, top_k, top_p, min_p, seed)
    (L10, 1.0, -1, 1.0, 0.0, 1),
    (L10, 1.0, 4, 1.0, 0.0, 2),
    (L10, 1.0, -1, 0.8, 0.0, 3),
    (L10, 1.0, -1, 1.0, 0.2, 4),
    (L24, 1.3, 8, 0.7, 0.02, 5),
    (L50, 1.5, -1, 0.85, 0.15, 6),
    (L50, 1.0, 20, 0.9, 0.11, 8),
]


@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: f"V{len(c[0])}-T{c[1]}-k{c[2]}-p{c[3]}-minp{c[4]}")
def test_sampled_frequencies_match_reference(case):
    logits, T, k, p, mp, seed = case
    keep, dist = ref_truncate(logits, T, k, p, mp)
    s = sample_many(logits, seed=seed, temperature=T, top_k=k, top_p=p, min_p=mp)
    assert set(np.unique(s)) <= set(np.flatnonzero(keep))
    # every allowed token with expected count >= 20 shows up
    assert set(np.flatnonzero(dist * len(s) >= 20)) <= set(np.unique(s))
    untruncated = ref_softmax(np.asarray(logits) / T)
    assert_distribution(s, dist, f"T={T} k={k} p={p} min_p={mp}",
                        wrong=None if keep.all() else untruncated)


@pytest.mark.parametrize("T", [0.5, 2.0])
def test_temperature_scales_logits(T):
    s = sample_many(L10, seed=11, temperature=T)
    assert_distribution(s, ref_softmax(L10 / T), f"temperature {T}", wrong=ref_softmax(L10))


def test_tiny_temperature_is_near_greedy_and_below_epsilon_is_greedy():
    s = sample_many(L10, n=2000, seed=3, temperature=0.01)
    assert (s == int(np.argmax(L10))).all()  # next-best is 0.5/0.01 = 50 nats behind
    flat = np.zeros(10)
    flat[[2, 7]] = 1.0  # tie: greedy must pick the lowest id
    s = sample_many(flat, n=50, seed=3, temperature=5e-6)
    assert (s == 2).all()


def test_seeded_generators_sample_the_right_distribution():
    """Per-request generators (one per row) also draw from softmax(l / T)."""
    n, T = 6000, 2.0
    logits = torch.tensor(L10, dtype=torch.float32).expand(n, 10).contiguous()
    meta = make_meta(n, temperature=T, generators={i: gen(10_000 + i) for i in range(n)})
    s = Sampler(None)(logits, meta).sampled.numpy()
    assert_distribution(s, ref_softmax(L10 / T), "seeded rows", wrong=ref_softmax(L10))


# --- greedy ---------------------------------------------------------------------------

def test_greedy_is_argmax_with_lowest_id_on_ties():
    rng = np.random.default_rng(5)
    lg = rng.normal(size=(6, 37)).astype(np.float32)
    lg[3, [4, 30]] = 10.0  # tie
    meta = make_meta(6, temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)  # ignored when greedy
    out = Sampler(gen(0))(torch.tensor(lg), meta).sampled.numpy()
    expect = lg.argmax(axis=1)
    assert expect[3] == 4
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("all_greedy", [False, True])
def test_greedy_is_argmax_after_penalties_and_min_tokens(all_greedy):
    """The engine sets all_greedy (a host-side flag that skips the per-row masks) when
    every row is greedy; both paths must pick argmax of the penalised, masked logits."""
    rng = np.random.default_rng(8)
    lg = rng.normal(size=(4, 30)).astype(np.float32)
    out_ids = [[int(lg[r].argmax())] for r in range(4)]  # the current argmax was emitted
    meta = make_meta(4, temperature=0.0, all_greedy=all_greedy,
                     repetition_penalty=torch.full((4,), 5.0),
                     prompt_token_ids=[[] for _ in range(4)], output_token_ids=out_ids,
                     min_tokens_block={2: [int(np.argsort(lg[2])[-2])]})
    got = Sampler(gen(0))(torch.tensor(lg), meta).sampled.numpy()
    want = lg.copy()
    for r in range(4):
        t = out_ids[r][0]
        want[r, t] = want[r, t] / 5.0 if want[r, t] > 0 else want[r, t] * 5.0
    want[2, meta.min_tokens_block[2]] = -np.inf
    np.testing.assert_array_equal(got, want.argmax(axis=1))
    assert all(got[r] != out_ids[r][0] or lg[r].max() <= 0 for r in range(4))


def test_greedy_rows_unaffected_by_random_rows_in_the_same_batch():
    rng = np.random.default_rng(6)
    lg = torch.tensor(rng.normal(size=(8, 40)), dtype=torch.float32)
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 0.7, 1.0, 0.0]
    meta = make_meta(8, temperature=temps, top_k=[-1, 5, -1, -1, 3, -1, 2, -1])
    for seed in range(5):
        out = Sampler(gen(seed))(lg, meta).sampled.numpy()
        for i, t in enumerate(temps):
            if t == 0.0:
                assert out[i] == int(lg[i].argmax())


# --- penalties ------------------------------------------------------------------------

PENALTY_ROWS = [
    # (prompt ids, output ids, repetition, frequency, presence)
    ([1, 2, 3], [3, 3, 5, 7], 1.3, 0.0, 0.0),
    ([1, 2, 3], [3, 3, 5, 7], 1.0, 0.5, 0.0),
    ([1, 2, 3], [3, 3, 5, 7], 1.0, 0.0, 0.8),
    ([0, 4, 4, 9], [9, 9, 9, 2, 11], 1.7, 0.6, 1.1),
    ([], [], 2.0, 2.0, 2.0),                       # nothing seen: no change
    ([6, 8], [8, 1], 0.5, -1.0, -0.5),             # penalties < 1 / negative reward
    ([10, 11], [], 1.5, 2.0, 2.0),                 # prompt only: only repetition applies
]


def test_apply_penalties_matches_reference_formula():
    rng = np.random.default_rng(7)
    V = 16
    lg = rng.normal(0.0, 2.0, size=(len(PENALTY_ROWS), V)).astype(np.float32)
    lg[:, 3] = [-1.5, 0.0, 2.5, 1.0, 0.4, -0.7, 3.0]  # both signs and zero on a repeated id
    meta = SamplingMetadata(
        temperature=torch.ones(len(PENALTY_ROWS)),
        repetition_penalty=torch.tensor([r[2] for r in PENALTY_ROWS]),
        frequency_penalty=torch.tensor([r[3] for r in PENALTY_ROWS]),
        presence_penalty=torch.tensor([r[4] for r in PENALTY_ROWS]),
        prompt_token_ids=[r[0] for r in PENALTY_ROWS],
        output_token_ids=[r[1] for r in PENALTY_ROWS])
    x = torch.tensor(lg)
    got = apply_penalties(x, meta).numpy()
    assert torch.equal(x, torch.tensor(lg)), "apply_penalties changed its input"
    for i, (prompt, output, rep, freq, pres) in enumerate(PENALTY_ROWS):
        ref = ref_penalties(lg[i], prompt, output, rep, freq, pres)
        np.testing.assert_allclose(got[i], ref, rtol=1e-6, atol=1e-6, err_msg=f"row {i}")
    # untouched ids stay bit-identical
    assert got[4].tolist() == lg[4].tolist()
    # prompt-only ids get the repetition penalty but no frequency/presence penalty
    assert got[6, 10] == pytest.approx(lg[6, 10] / 1.5 if lg[6, 10] > 0 else lg[6, 10] * 1.5)


def test_only_requested_penalties_apply():
    lg = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)
    meta = SamplingMetadata(temperature=torch.ones(1), frequency_penalty=torch.tensor([0.5]),
                            prompt_token_ids=[[0, 1]], output_token_ids=[[2, 2]])
    got = apply_penalties(torch.tensor(lg), meta).numpy()[0]
    np.testing.assert_allclose(got, [1.0, -1.0, 1.0, 0.5])  # prompt ids untouched by frequency


def test_penalties_change_greedy_choice_as_reference_predicts():
    V = 12
    base = np.linspace(-1.0, 1.0, V)[::-1].copy()  # id 0 best, then 1, 2 ...
    base[5] = 1.05  # id 5 best of all
    base[7] = -0.8
    rows = [
        # (prompt, output, rep, freq, pres)
        ([5], [], 1.5, 0.0, 0.0),           # 1.05/1.5 = 0.7 < 1.0 (id 0) -> 0
        ([], [5], 1.0, 0.1, 0.0),           # 1.05 - 0.1 = 0.95 -> 0
        ([], [5], 1.0, 0.02, 0.0),          # 1.03 -> still 5
        ([], [5, 5, 5], 1.0, 0.02, 0.0),    # 0.99 -> 0
        ([], [5, 0], 1.0, 0.0, 0.2),        # 0.85 vs 0.8 -> 5
        ([], [5, 0, 1], 1.0, 0.0, 0.2),     # 0.85, 0.8, 0.618 -> 5
        ([0, 5], [1], 2.0, 0.0, 0.5),       # 0.525, 0.5, 0.409/2-0.5 ; id2 0.636 -> 2
        ([], [7], 1.0, -2.0, -2.0),         # reward: -0.8 + 4 = 3.2 -> 7
    ]
    lg = np.tile(base, (len(rows), 1)).astype(np.float32)
    meta = SamplingMetadata(
        temperature=torch.zeros(len(rows)),
        repetition_penalty=torch.tensor([r[2] for r in rows]),
        frequency_penalty=torch.tensor([r[3] for r in rows]),
        presence_penalty=torch.tensor([r[4] for r in rows]),
        prompt_token_ids=[r[0] for r in rows], output_token_ids=[r[1] for r in rows])
    out = Sampler(gen(0))(torch.tensor(lg), meta).sampled.numpy()
    expect = [int(np.argmax(ref_penalties(lg[i].astype(np.float64), *r))) for i, r in enumerate(rows)]
    assert expect == [0, 0, 5, 0, 5, 5, 2, 7]  # the reference itself, worked by hand above
    np.testing.assert_array_equal(out, expect)


def test_penalised_distribution_is_sampled():
    prompt, output = [1, 4], [2, 2, 6]
    rep, freq, pres, T = 1.4, 0.3, 0.4, 0.9
    pen = ref_penalties(L10, prompt, output, rep, freq, pres)
    meta_kw = dict(repetition_penalty=torch.full((N_SAMPLES,), rep),
                   frequency_penalty=torch.full((N_SAMPLES,), freq),
                   presence_penalty=torch.full((N_SAMPLES,), pres),
                   prompt_token_ids=[prompt] * N_SAMPLES, output_token_ids=[output] * N_SAMPLES)
    logits = torch.tensor(L10, dtype=torch.float32).expand(N_SAMPLES, 10).contiguous()
    s = Sampler(gen(21))(logits, make_meta(N_SAMPLES, temperature=T, **meta_kw)).sampled.numpy()
    assert_distribution(s, ref_softmax(pen / T), "penalised", wrong=ref_softmax(L10 / T))


# --- seeds and batch composition -------------------------------------------------------

def _draw_sequence(seed, steps=25, logits=L50, T=1.0, **params):
    g = gen(seed)
    row = torch.tensor(logits, dtype=torch.float32)[None]
    return [int(Sampler(None)(row, make_meta(1, temperature=T, generators={0: g}, **params))
                .sampled[0]) for _ in range(steps)]


def test_same_seed_same_samples_different_seed_different():
    a = _draw_sequence(123)
    b = _draw_sequence(123)
    c = _draw_sequence(124)
    assert a == b
    assert a != c  # 25 draws over 50 tokens with max p < 0.1: equal with prob < 1e-25
    assert len(set(a)) > 3  # really random, not constant
    # the same holds with truncation active
    assert _draw_sequence(5, top_k=10, top_p=0.8) == _draw_sequence(5, top_k=10, top_p=0.8)


def test_seeded_row_unaffected_by_other_rows():
    """A seeded row draws the same tokens alone and at any position of any batch, with
    other seeded, unseeded and greedy rows around it, different params and logits."""
    steps = 20
    alone = _draw_sequence(99, steps=steps, T=0.8, top_k=30, min_p=0.01)
    g_target = gen(99)
    g_other1, g_other2 = gen(1), gen(2)
    default = gen(0)
    rng = np.random.default_rng(8)
    got = []
    for step in range(steps):
        B = 2 + step % 5
        pos = step % B
        lg = rng.normal(size=(B, 50)).astype(np.float32)
        lg[pos] = L50
        temps = [0.0 if (i + step) % 3 == 0 else 1.5 for i in range(B)]
        temps[pos] = 0.8
        top_k = [-1] * B
        top_k[pos] = 30
        top_p = [0.5 + 0.1 * (i % 4) for i in range(B)]
        top_p[pos] = 1.0
        min_p = [0.0] * B
        min_p[pos] = 0.01
        gens = {pos: g_target}
        others = [i for i in range(B) if i != pos]
        if len(others) >= 1:
            gens[others[0]] = g_other1
        if len(others) >= 3:
            gens[others[2]] = g_other2
        meta = make_meta(B, temperature=temps, top_k=top_k, top_p=top_p, min_p=min_p,
                         generators=gens)
        got.append(int(Sampler(default)(torch.tensor(lg), meta).sampled[pos]))
    assert got == alone


def test_unseeded_rows_reproducible_from_engine_generator():
    lg = torch.tensor(np.tile(L24, (16, 1)), dtype=torch.float32)
    a = Sampler(gen(5))(lg, make_meta(16)).sampled
    b = Sampler(gen(5))(lg, make_meta(16)).sampled
    c = Sampler(gen(6))(lg, make_meta(16)).sampled
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- logprobs -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 3, 7])
def test_logprobs_are_raw_log_softmax_with_correct_ranks(n):
    rng = np.random.default_rng(9)
    B, V = 5, 30
    lg = rng.normal(0.0, 2.0, size=(B, V)).astype(np.float32)
    eos = 4
    lg[:, eos] = 6.0  # the best token everywhere; row 0 blocks it (min_tokens)
    meta = make_meta(B, temperature=[0.0, 1.5, 0.0, 0.7, 3.0], top_k=[-1, 5, -1, -1, -1],
                     max_num_logprobs=n, min_tokens_block={0: [eos]},
                     repetition_penalty=torch.full((B,), 1.3),
                     frequency_penalty=torch.full((B,), 0.7),
                     prompt_token_ids=[[1, 2]] * B, output_token_ids=[[2, 5, 5]] * B,
                     generators={1: gen(1), 3: gen(3)})
    out = Sampler(gen(0))(torch.tensor(lg), meta)
    sampled = out.sampled.numpy()
    assert sampled[0] != eos and sampled[2] == eos
    for i in range(B):
        ref = ref_log_softmax(lg[i].astype(np.float64))  # raw: no penalties, no temperature
        tok = int(sampled[i])
        assert float(out.sampled_logprobs[i]) == pytest.approx(ref[tok], abs=1e-5)
        assert int(out.sampled_ranks[i]) == 1 + int((ref > ref[tok]).sum())
        if n == 0:
            assert out.topk_ids is None or out.topk_ids.shape[1] == 0
            continue
        order = np.argsort(-ref)[:n]
        np.testing.assert_array_equal(out.topk_ids[i].numpy(), order)
        np.testing.assert_allclose(out.topk_logprobs[i].numpy(), ref[order], atol=1e-5)
    # rank of the min_tokens-blocked row's token: EOS outranks it in the raw distribution
    assert int(out.sampled_ranks[0]) >= 2


def test_no_logprobs_when_not_asked():
    out = Sampler(gen(0))(torch.tensor(L10, dtype=torch.float32)[None], make_meta(1))
    assert out.sampled_logprobs is None and out.topk_ids is None and out.sampled_ranks is None


# --- min_tokens -------------------------------------------------------------------------

def test_min_tokens_block_masks_eos_and_stop_ids_only_for_blocked_rows():
    V, eos, stop = 20, 2, 9
    lg = np.zeros((4, V), np.float32)
    lg[:, eos] = 12.0      # overwhelmingly likely ...
    lg[:, stop] = 11.0     # ... and a stop id close behind
    lg[:, 13] = 1.0
    block = {0: [eos, stop], 1: [eos, stop]}
    temps = [0.0, 1.0, 0.0, 1.0]
    for seed in range(30):
        meta = make_meta(4, temperature=temps, min_tokens_block=block, generators={1: gen(seed)})
        x = torch.tensor(lg)
        out = Sampler(gen(seed))(x, meta).sampled.numpy()
        assert torch.equal(x, torch.tensor(lg)), "the sampler changed the caller's logits"
        assert out[0] == 13                      # greedy falls to the best unblocked id
        assert out[1] not in (eos, stop)         # random never draws a blocked id
        assert out[2] == eos                     # unblocked rows are unaffected
    # the blocked random row samples the reference distribution over the remaining ids
    n = N_SAMPLES
    meta = make_meta(n, temperature=1.0, min_tokens_block={i: [eos, stop] for i in range(n)})
    s = Sampler(gen(77))(torch.tensor(lg[1]).expand(n, V).contiguous(), meta).sampled.numpy()
    ref_lg = lg[1].astype(np.float64)
    ref_lg[[eos, stop]] = -np.inf
    assert_distribution(s, ref_softmax(ref_lg), "min_tokens")
