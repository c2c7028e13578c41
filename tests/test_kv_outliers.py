"""Chapter 19's K-outlier reparametrization (faults.k_outlier_reparam) on the tiny random
Llama (2 layers, 4 query heads, 2 KV heads, head_dim 16).

What must hold, checked against computations written out here (not the code under test):

- the reparametrization is exact: with c a power of two a float32 engine's logits are
  bit-identical to the unmodified engine's; with c = 50 (not a power of two) the mean KL
  stays at the float32 noise floor (< 1e-9 nats, printed);
- the planted K channels (the chosen dimension and its rotary partner, of the chosen KV
  head and layer) have exactly c times their old amax and every other channel keeps its
  amax (read from a float32 cache after a prefill);
- with an int8 KV cache, per-channel K scales calibrated under the fault give the same
  logits as without it (the scales absorb c exactly), while per-tensor scales lose: the
  KL against float32 grows more than tenfold;
- bad arguments raise, and the engine is itself again after the block.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.precision import faults, metrics
from minivllm.quantization.kv_cache import kv_scales_from_amax

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5 + (7 * i) % 90 for i in range(24)]
CALIB = [3 + (11 * i) % 97 for i in range(40)]
D = 16  # the tiny model's head_dim


def _llm(model_dir, kv="float32", **kw):
    return LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv, max_model_len=64,
               num_gpu_blocks_override=16, enable_prefix_caching=False, seed=0, **kw)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return _llm(tiny_model_dir)


def _k_amax(llm, ids):
    """Per layer, max |K| per (KV head, channel) of what a prefill of ``ids`` stores
    (the float32 cache zeroed first)."""
    for kv in llm.llm_engine.model_runner.kv_caches:
        kv.key.zero_(), kv.value.zero_()
    llm.score([ids])
    return torch.stack([kv.key.abs().amax(0) for kv in llm.llm_engine.model_runner.kv_caches])


def test_reparam_is_exact_in_float32(ref):
    clean = ref.score(IDS, output="logits")
    with faults.k_outlier_reparam(ref, layer=1, head=1, channel=3, c=64.0) as planted:
        assert planted == [(1, 1, 3), (1, 1, 3 + D // 2)]
        same = ref.score(IDS, output="logits")
    assert torch.equal(same, clean), float((same - clean).abs().max())
    with faults.k_outlier_reparam(ref, layer=[0, 1], head=[0, 1], channel=[2, 13], c=50.0):
        near = ref.score(IDS, output="logits")
    kl = metrics.mean_kl(clean, near)
    print(f"c=50 in both layers and heads: mean KL {kl:.2e} nats, max |logit diff| "
          f"{float((near - clean).abs().max()):.2e}")
    assert kl < 1e-9  # float32 noise floor ~1e-11 (DESIGN); a real change is >= 1e-6
    assert torch.equal(ref.score(IDS, output="logits"), clean)  # restored on exit


def test_planted_channels_grow_by_c_and_no_other(ref):
    before = _k_amax(ref, CALIB)
    c = 64.0
    with faults.k_outlier_reparam(ref, layer=0, head=1, channel=11, c=c) as planted:
        after = _k_amax(ref, CALIB)
    dims = {11, 11 - D // 2}
    assert sorted(planted) == [(0, 1, d) for d in sorted(dims)]
    expect = before.clone()
    for d in dims:
        expect[0, 1, d] *= c
    print(f"planted channels: amax {before[0, 1, sorted(dims)].tolist()} -> "
          f"{after[0, 1, sorted(dims)].tolist()}")
    assert torch.equal(after, expect)  # c a power of two: exact
    assert torch.equal(_k_amax(ref, CALIB), before)  # restored on exit


def _set_int8_scales(llm, k_amax, v_amax, per_channel):
    for kv, k, v in zip(llm.llm_engine.model_runner.kv_caches, k_amax, v_amax):
        kv.set_scales(kv_scales_from_amax(k if per_channel else k.max(), 127.0),
                      kv_scales_from_amax(v, 127.0))


def test_per_channel_int8_absorbs_the_outlier_per_tensor_does_not(ref, tiny_model_dir):
    want = ref.score(IDS, output="logits")
    k0 = _k_amax(ref, CALIB)
    v0 = torch.stack([kv.value.abs().max() for kv in ref.llm_engine.model_runner.kv_caches])
    int8 = _llm(tiny_model_dir, "int8", kv_scale=(1.0, 1.0))
    kls = {}
    for per_channel in (True, False):
        _set_int8_scales(int8, k0, v0, per_channel)
        plain = int8.score(IDS, output="logits")
        with faults.k_outlier_reparam(ref, 1, 0, 5, 64.0), \
                faults.k_outlier_reparam(int8, 1, 0, 5, 64.0):
            k1 = _k_amax(ref, CALIB)  # calibration sees the outliers
            _set_int8_scales(int8, k1, v0, per_channel)
            planted = int8.score(IDS, output="logits")
        kls[per_channel] = (metrics.mean_kl(want, plain), metrics.mean_kl(want, planted))
        if per_channel:
            assert torch.equal(planted, plain)
    print(f"int8 KL vs float32 (unmodified, planted): per channel {kls[True]}, "
          f"per tensor {kls[False]}")
    assert kls[False][1] > 10 * kls[False][0]


def test_bad_arguments_raise(ref):
    for kw in (dict(c=0.0), dict(c=float("inf")), dict(c=True), dict(layer=2), dict(head=2),
               dict(channel=D), dict(channel=[]), dict(head=-1)):
        args = dict(layer=0, head=0, channel=0, c=64.0) | kw
        with pytest.raises(ValueError):
            with faults.k_outlier_reparam(ref, **args):
                pass
    with pytest.raises(TypeError):
        with faults.k_outlier_reparam(ref, layer=0, head=0, channel=1.5):
            pass
