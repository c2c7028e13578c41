"""Chapter 10's step and faults: the "fused_add_rms_norm" step (every residual add goes
through it; its reference, and the "embedding" step's, leave the logits bit-identical),
faults.rmsnorm_no_upcast (the mean square in the activation dtype) and
faults.residual_scale_reparam (the residual stream scaled by c, compensated exactly).

Expected values come from the engine's own unswapped runs, from hand-written rows, and
from facts measured on the embedded model (its residual peak of ~22.5k, the first layer
past it, 11); nothing is copied from the code under test. Tolerances: float32 KL of an
exact reparametrization <= 1e-10 nats (the noise floor measured in chapter 4 is
5e-12..3e-11); float16 numbers as noted per test.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm import LLM
from minivllm.layers.rms_norm import RMSNorm, fused_add_rms_norm_ref, rms_norm_ref
from minivllm.models.llama import embedding_ref
from minivllm.precision import evalsets, faults, metrics
from minivllm.precision.layer_diff import capture_hidden_states, find_first_jump, relative_error
from minivllm.precision.overflow import track_nonfinite

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = [5 + (11 * i) % 300 for i in range(24)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)


def test_reference_steps_are_bit_identical_and_see_every_add(tiny):
    want = tiny.score(IDS, output="logits")
    calls = []

    def spy(x, residual, weight, eps):
        calls.append(x.shape[0])
        return fused_add_rms_norm_ref(x, residual, weight, eps)

    with tiny.swap_step("fused_add_rms_norm", spy), tiny.swap_step("embedding", embedding_ref):
        got = tiny.score(IDS, output="logits")
    assert torch.equal(got, want)
    n = len(tiny.llm_engine.model_runner.model.layers)
    assert len(calls) == 2 * n, f"{len(calls)} residual adds seen, expected 2 per layer ({n})"
    norms = [m for m in tiny.llm_engine.model_runner.model.modules() if isinstance(m, RMSNorm)]
    assert all(m.add_impl is None for m in norms)


def test_fused_add_reference_by_hand():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]], dtype=torch.float16)
    r = torch.tensor([[3.0, 2.0, 1.0, -0.5]], dtype=torch.float16)
    w = torch.tensor([1.0, 2.0, 1.0, 1.0], dtype=torch.float16)
    normed, res = fused_add_rms_norm_ref(x, r, w, 0.0)
    assert res.dtype == torch.float16 and res.tolist() == [[4.0, 0.0, 4.0, 0.0]]
    # mean square 8, rms 2*sqrt(2): [sqrt2, 0, sqrt2, 0] * w
    want = torch.tensor([[math.sqrt(2), 0.0, math.sqrt(2), 0.0]]).to(torch.float16) * w
    assert torch.equal(normed, want)
    big = torch.full((1, 4), 60000.0, dtype=torch.float16)
    assert torch.isinf(fused_add_rms_norm_ref(big, big, w, 1e-5)[1]).all()  # 120000 > 65504


def test_no_upcast_norm_by_hand():
    w = torch.ones(4, dtype=torch.float16)
    row = torch.tensor([[300.0, 1.0, -2.0, 4.0]], dtype=torch.float16)  # 300^2 = 90000
    bad = faults.rms_norm_no_upcast(row, w, 1e-5)
    assert torch.equal(bad, torch.zeros_like(bad)), bad  # inf variance: the row is zeroed
    assert torch.isfinite(rms_norm_ref(row, w, 1e-5)).all() and rms_norm_ref(row, w, 1e-5).abs().max() > 1
    x32 = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 100
    w32 = torch.rand(64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(faults.rms_norm_no_upcast(x32, w32, 1e-5), rms_norm_ref(x32, w32, 1e-5))


def test_reparam_restores_engine_and_checks_c(tiny):
    norms = [m for m in tiny.llm_engine.model_runner.model.modules() if isinstance(m, RMSNorm)]
    eps = [m.eps for m in norms]
    want = tiny.score(IDS)
    with faults.residual_scale_reparam(tiny, 3.0):
        assert all(m.eps == pytest.approx(9 * e) for m, e in zip(norms, eps))
        got = tiny.score(IDS)
    assert [m.eps for m in norms] == eps
    kl = metrics.mean_kl(want, got)
    print(f"tiny model, c=3, float32: KL {kl:.2e}")
    assert kl <= 1e-10
    assert torch.equal(tiny.score(IDS), want)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "4"):
        with pytest.raises(ValueError, match="c must be"):
            with faults.residual_scale_reparam(tiny, bad):
                pass


@pytest.mark.embedded
class TestEmbedded:
    @pytest.fixture(scope="class")
    @classmethod
    def f32(cls, embedded_model_dir):
        return LLM(str(embedded_model_dir), dtype="float32", max_model_len=256)

    @pytest.fixture(scope="class")
    @classmethod
    def f16(cls, embedded_model_dir):
        return LLM(str(embedded_model_dir), dtype="float16", max_model_len=256)

    @pytest.fixture(scope="class")
    @classmethod
    def window(cls, f32):
        return evalsets.corpus_sequences(f32.get_tokenizer(), seq_len=48, max_sequences=1)[0]

    def test_reparam_is_exact_in_float32(self, f32, window):
        base = f32.score(window)
        for c in (4.0, 3.0):
            with faults.residual_scale_reparam(f32, c):
                got = f32.score(window)
            kl = metrics.mean_kl(base, got)
            print(f"c={c}: float32 KL {kl:.2e}, bit-identical {torch.equal(base, got)}")
            assert kl <= 1e-10, f"c={c}: KL {kl:.3e} above the float32 noise floor 1e-10"
        # c = 4 is a power of two: only exponents change, so float32 is bit-identical
        with faults.residual_scale_reparam(f32, 4.0):
            assert torch.equal(f32.score(window), base)

    def test_reparam_overflows_fp16_at_layer_11(self, f16, window):
        plain = f16.score(window)
        assert torch.isfinite(plain).all()  # the unmodified model: peak ~22.5k < 65504
        with faults.residual_scale_reparam(f16, 4.0), track_nonfinite(f16) as counts:
            got = f16.score(window)
        print(f"first non-finite: {counts.first()}; NaN rows {int(torch.isnan(got).any(-1).sum())}"
              f"/{len(window)}")
        assert counts.first() == "layers.11.mlp", counts.rows()[:40]
        assert not torch.isfinite(got).all()
        with faults.residual_scale_reparam(f16, 2.0):  # peak ~45k: still in range, same bits
            assert torch.equal(f16.score(window), plain)

    def test_layer_diff_finds_no_upcast_norm(self, f16, f32, window):
        base = f32.score(window)
        with faults.rmsnorm_no_upcast(f32):  # float32: the fault computes the reference
            assert torch.equal(f32.score(window), base)
        # against the correct fp16 engine (same bits up to the fault; against float32 the
        # jump at layer 17 is only ~3x on the residual stream, whose norm the 22.5k
        # massive activation dominates)
        with faults.rmsnorm_no_upcast(f16, where=17):
            bad = capture_hidden_states(f16, window)
        good = capture_hidden_states(f16, window)
        errors = {p: relative_error(bad[p], good[p]) for p in good}
        print({p: f"{e:.1e}" for p, e in errors.items() if p.startswith(("layers.16", "layers.17"))})
        assert find_first_jump(errors, 30) == (17, "self_attn")
        assert errors["layers.16"] == 0.0
        clean = f16.score(window)
        with faults.rmsnorm_no_upcast(f16):
            bad = f16.score(window)
        kl = metrics.mean_kl(clean, bad)
        print(f"no-upcast RMSNorm in every layer, fp16: KL vs the correct fp16 engine {kl:.3f}")
        assert kl > 1.0
