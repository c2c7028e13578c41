"""Chapter 9: the fully-masked-row guard on both attention backends, and the softmax /
attention faults (faults.qk_scale_reparam, eager_kq_attention, softmax_without_max).

The guard: a query row with no key to attend to (a padding row with seq_len 0, a mask row
with no True, a prefill row before its sequence's first key) gives exactly 0, never NaN,
also when the keys it must not read hold NaN (FlashAttention-2's convention). Expected
values are float64 attention written out here, not the code under test.

The faults, on the embedded model (float16 engine, a short prompt): the reparametrization
changes nothing on the default path (the engine multiplies by the scale before anything
is rounded to fp16) and is exact in float32 (KL at the noise floor); under eager fp16
``q @ k^T`` it overflows, and the layer diff names the first layer whose largest positive
raw score times c passes 65504 (computed here from the clean run). A softmax without max
subtraction is harmless in float32 on the tiny model and NaN in float16 from the first
layer whose largest scaled score passes ln(65504) = 11.09.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.backends.torch_ref import (decode_attention_batch_invariant,
                                                   decode_attention_ref,
                                                   prefill_attention_masked,
                                                   prefill_attention_ref)
from minivllm.precision import faults, metrics
from minivllm.precision.layer_diff import (capture_hidden_states, find_first_jump,
                                            relative_error)
from minivllm.precision.overflow import track_nonfinite

pytestmark = pytest.mark.usefixtures("one_thread")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# attention outputs (magnitude ~1) vs float64: max |out - ref| per dtype
TOL = {F32: 1e-5, F16: 4e-3, BF16: 3e-2}


def attention64(q, k, v, mask, scale):
    """float64 attention written out: q [n, H, D], k/v [L, Hkv, D], mask [n, L] bool;
    rows with no True key are 0."""
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # all -inf -> NaN -> 0
    return torch.einsum("hnl,lhd->nhd", p, vv)


def check_close(out, ref, dtype, what):
    assert torch.isfinite(out).all(), f"{what}: {int((~torch.isfinite(out)).sum())} non-finite"
    err = (out.double() - ref).abs().max().item()
    print(f"{what}: max |err| {err:.2e} (tol {TOL[dtype]})")
    assert err <= TOL[dtype], f"{what}: max |err| {err:.3g} > {TOL[dtype]}"


# ------------------------------------------------------------------ TORCH backend guard

@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_torch_decode_padding_rows_are_zero(dtype):
    torch.manual_seed(0)
    B, H, Hkv, D, L = 4, 6, 2, 16, 9
    q = torch.randn(B, H, D).to(dtype)
    k = torch.randn(B, L, Hkv, D).to(dtype)
    v = torch.randn(B, L, Hkv, D).to(dtype)
    lens = torch.tensor([9, 0, 3, 0])
    # a padding row's keys may be anything, NaN included (a real row's padding keys are
    # finite by the step's contract: the backend zeroes them once a NaN was stored)
    k[lens == 0] = float("nan")
    v[lens == 0] = float("nan")
    for fn in (decode_attention_ref, decode_attention_batch_invariant):
        out = fn(q, k, v, lens, D ** -0.5)
        assert out.dtype == dtype and out.shape == (B, H, D)
        assert (out[1] == 0).all() and (out[3] == 0).all(), f"{fn.__name__}: padding rows"
        for b in (0, 2):
            n = int(lens[b])
            ref = attention64(q[b:b + 1], k[b, :n], v[b, :n], torch.ones(1, n, dtype=torch.bool),
                              D ** -0.5)[0]
            check_close(out[b], ref, dtype, f"{fn.__name__} row {b} ({dtype})")


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_torch_masked_prefill_empty_rows_are_zero(dtype):
    """prefill_attention_masked (a swapped "prefill_chunk" step's mask) with rows that
    see nothing, like the left-padded rows of transformers batches (unsloth #9848)."""
    torch.manual_seed(1)
    n, L, H, Hkv, D = 5, 7, 4, 2, 8
    q, k, v = torch.randn(n, H, D).to(dtype), torch.randn(L, Hkv, D).to(dtype), \
        torch.randn(L, Hkv, D).to(dtype)
    mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    mask[:, :3] = False  # keys 0..2 are left padding
    mask[0] = False
    mask[1] = False
    out = prefill_attention_masked(q, k, v, mask, D ** -0.5)
    assert (out[:2] == 0).all()
    check_close(out, attention64(q, k, v, mask, D ** -0.5), dtype, f"masked prefill {dtype}")
    # the standard causal step is untouched by the guard: equal to the masked path
    causal = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    assert torch.equal(prefill_attention_ref(q, k, v, D ** -0.5),
                       prefill_attention_masked(q, k, v, causal, D ** -0.5))


def test_torch_engine_path_unchanged_by_guard(tiny_model_dir):
    """The guard only touches empty rows: the engine's decode logits equal a decode step
    without it (the SDPA call alone) bit for bit."""
    import torch.nn.functional as F

    def decode_no_guard(q, k, v, seq_lens, scale):
        L = k.shape[1]
        mask = (torch.arange(L)[None, :] < seq_lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2),
                                              v.transpose(1, 2), attn_mask=mask, scale=scale,
                                              enable_gqa=True).squeeze(2)

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0)
    ids = [[5 + (7 * i) % 90 for i in range(n)] for n in (13, 6, 9)]
    with_guard = llm.score(ids, mode="decode", output="logits")
    with llm.swap_step("attention.decode", decode_no_guard):
        without = llm.score(ids, mode="decode", output="logits")
    assert all(torch.equal(a, b) for a, b in zip(with_guard, without))


# ----------------------------------------------------------------- TRITON backend guard

def _paged(lens, Hkv, D, bs, dtype, nan_blocks=True):
    """A paged cache whose blocks are all NaN except the ones holding the sequences' K/V;
    a length-0 row's block table points into NaN blocks."""
    nblocks = sum(-(-n // bs) for n in lens) + 2
    kc = torch.full((nblocks * bs, Hkv, D), float("nan"), dtype=dtype)
    vc = kc.clone()
    width = max(1, max(-(-n // bs) for n in lens))
    bt = torch.full((len(lens), width), nblocks - 1, dtype=torch.int32)  # a NaN block
    k_seqs, v_seqs, nxt = [], [], 0
    for b, n in enumerate(lens):
        k, v = torch.randn(n, Hkv, D).to(dtype), torch.randn(n, Hkv, D).to(dtype)
        for j in range(-(-n // bs)):
            bt[b, j] = nxt
            m = min(bs, n - j * bs)
            kc[nxt * bs:nxt * bs + m] = k[j * bs:j * bs + m]
            vc[nxt * bs:nxt * bs + m] = v[j * bs:j * bs + m]
            nxt += 1
        k_seqs.append(k)
        v_seqs.append(v)
    return kc, vc, bt, k_seqs, v_seqs


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_triton_decode_and_prefill_empty_rows_are_zero(dtype):
    from minivllm_kernels.paged_attention import paged_attention_decode
    from minivllm_kernels.prefill_attention import paged_prefill_attention

    torch.manual_seed(2)
    H, Hkv, D, bs = 4, 2, 16, 8
    scale = D ** -0.5
    # decode: two padding rows (seq_len 0, block tables into NaN blocks), both launch forms
    lens = [0, 11, 0, 20]
    kc, vc, bt, ks, vs = _paged(lens, Hkv, D, bs, dtype)
    q = torch.randn(len(lens), H, D).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    for spp in (1, None):
        out = paged_attention_decode(q, kc, vc, bt, sl, bs, scale, splits_per_program=spp)
        assert (out[0] == 0).all() and (out[2] == 0).all()
        for b in (1, 3):
            ref = attention64(q[b:b + 1], ks[b], vs[b],
                              torch.ones(1, lens[b], dtype=torch.bool), scale)[0]
            check_close(out[b], ref, dtype, f"triton decode row {b} spp={spp}")
    # prefill: sequence 0 has 6 new tokens but only 4 keys (rows 0, 1 see none: left
    # padding); sequence 1 is a normal prompt. Rows of q owned by no sequence stay put.
    qlens, klens = [6, 5], [4, 5]
    kc, vc, bt, ks, vs = _paged(klens, Hkv, D, bs, dtype)
    q = torch.randn(sum(qlens), H, D).to(dtype)
    out = paged_prefill_attention(q, kc, vc, bt, torch.tensor([0, 6], dtype=torch.int32),
                                  torch.tensor(qlens, dtype=torch.int32),
                                  torch.tensor(klens, dtype=torch.int32), bs, scale)
    assert (out[:2] == 0).all(), "rows with no key are not zero"
    for b, r0 in ((0, 0), (1, 6)):
        n, L = qlens[b], klens[b]
        mask = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        check_close(out[r0:r0 + n], attention64(q[r0:r0 + n], ks[b], vs[b], mask, scale),
                    dtype, f"triton prefill seq {b}")


def test_triton_backend_forward_padding_rows():
    """TritonAttentionBackend.forward with a CUDA-graph-style padded decode batch
    (seq_len 0 rows) over a cache holding NaN: padding rows 0, real rows finite."""
    from minivllm.attention.backends.triton_attn import TritonAttentionBackend
    from minivllm.attention.metadata import AttentionMetadata, PagedMetadata
    from minivllm.quantization.kv_cache import LayerKVCache

    torch.manual_seed(3)
    H, Hkv, D, bs = 4, 2, 16, 8
    lens = [9, 0, 0]
    kc, vc, bt, ks, vs = _paged(lens, Hkv, D, bs, F32)
    kv = LayerKVCache(key=kc, value=vc, k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    meta = AttentionMetadata(slot_mapping=torch.tensor([8, -1, -1]), paged=PagedMetadata(
        block_size=bs, decode_block_tables=bt,
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32), decode_max_seq_len=64))
    q = torch.randn(3, H, D)
    out = TritonAttentionBackend().forward(q, kv, meta, D ** -0.5)
    assert (out[1:] == 0).all()
    check_close(out[0], attention64(q[:1], ks[0], vs[0], torch.ones(1, 9, dtype=torch.bool),
                                    D ** -0.5)[0], F32, "backend row 0")


# ------------------------------------------------------------------------------ faults

IDS = [5 + (11 * i) % 90 for i in range(12)]


def test_qk_reparam_is_exact_in_float32_and_restores(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0)
    attn = llm.llm_engine.model_runner.model.layers[1].self_attn
    scaling = attn.scaling
    clean = llm.score(IDS, output="logits")
    clean_dec = llm.score(IDS, mode="decode", output="logits")
    for c in (256.0, 200.0):  # a power of two, and not
        with faults.qk_scale_reparam(llm, c):
            assert attn.scaling == scaling / c
            rows = llm.score(IDS, output="logits")
            dec = llm.score(IDS, mode="decode", output="logits")
        kl = max(metrics.mean_kl(clean, rows), metrics.mean_kl(clean_dec, dec))
        print(f"c={c}: float32 KL vs the unmodified model {kl:.2e}")
        assert kl <= 1e-10, f"c={c}: the reparametrization is not exact (KL {kl:.3g})"
    assert attn.scaling == scaling and attn.qkv_proj.impl is None
    assert torch.equal(llm.score(IDS, output="logits"), clean)
    with pytest.raises(ValueError, match="c must be"):
        with faults.qk_scale_reparam(llm, 0):
            pass
    with pytest.raises(ValueError, match="layers"):
        with faults.qk_scale_reparam(llm, 4.0, layers=[7]):
            pass


def test_softmax_without_max_is_harmless_in_float32(tiny_model_dir):
    """The tiny model's scaled scores are far below 88.7: no overflow, float32 KL at the
    noise floor (the fault needs float16, or larger scores, to show)."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0)
    clean = llm.score(IDS, output="logits")
    with faults.softmax_without_max(llm):
        rows = llm.score(IDS, output="logits")
    kl = metrics.mean_kl(clean, rows)
    print(f"softmax without max, float32, tiny model: KL {kl:.2e}")
    assert kl <= 1e-10


@pytest.fixture(scope="module")
def fp16_llm(embedded_model_dir):
    return LLM(str(embedded_model_dir), dtype="float16", max_model_len=128, seed=0)


EMB_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest."


def _score_stats(llm, ids):
    """Per layer: the largest positive raw score q.k and the largest scaled score, from a
    clean run (a spy on the "attention.prefill" step that calls the reference)."""
    n = len(llm.llm_engine.model_runner.model.layers)
    raw_max, scaled_max = [0.0] * n, [0.0] * n
    with contextlib.ExitStack() as stack:
        for i in range(n):
            def spy(q, k, v, scale, i=i):
                g = q.shape[1] // k.shape[1]
                s = torch.einsum("nhd,lhd->hnl", q.float(), k.float().repeat_interleave(g, 1))
                L, m = k.shape[0], q.shape[0]
                causal = torch.arange(L)[None, :] <= torch.arange(L - m, L)[:, None]
                top = float(s.masked_fill(~causal[None], float("-inf")).max())
                raw_max[i] = max(raw_max[i], top)
                scaled_max[i] = max(scaled_max[i], top * scale)
                return prefill_attention_ref(q, k, v, scale)
            stack.enter_context(llm.swap_step("attention.prefill", spy, where=i))
        rows = llm.score(ids, output="logits")
    return rows, raw_max, scaled_max


def _first_jump(llm, ids, fault):
    """The layer diff of the engine under ``fault()`` against the same engine clean
    (hidden states captured one after the other; layer_diff's jump rule)."""
    clean = capture_hidden_states(llm, ids)
    with fault():
        bad = capture_hidden_states(llm, ids)
    errors = {p: relative_error(bad[p], clean[p]) for p in clean}
    return find_first_jump(errors, len(llm.llm_engine.model_runner.model.layers))


def test_qk_reparam_overflows_only_under_eager_fp16(fp16_llm):
    llm = fp16_llm
    ids = llm.get_tokenizer().encode(EMB_TEXT)
    clean, raw_max, _ = _score_stats(llm, ids)
    print(f"largest positive raw q.k per layer: {[round(x) for x in raw_max]}")
    assert max(raw_max) < 65504 / 100  # the unmodified model is far from overflow
    c, layers = 1024.0, list(range(12, len(raw_max)))  # planted from layer 12 on
    first = next(i for i in layers if raw_max[i] * c > 65504)
    assert all(raw_max[i] * c < 0.97 * 65504 for i in layers if i < first), "no margin"
    with faults.qk_scale_reparam(llm, c, layers):
        rep = llm.score(ids, output="logits")
    kl = metrics.mean_kl(clean, rep)
    print(f"fp16, default path, c={c}: finite {bool(torch.isfinite(rep).all())}, KL {kl:.2e}")
    assert torch.isfinite(rep).all() and kl < 1e-4

    @contextlib.contextmanager
    def fault():
        with faults.qk_scale_reparam(llm, c, layers), faults.eager_kq_attention(llm, layers):
            yield

    with track_nonfinite(llm) as counts, fault():
        bad = llm.score(ids, output="logits")
    assert not torch.isfinite(bad).all()
    # the layer diff and the NaN count both name the first planted layer whose max raw
    # q.k x c passes 65504 (the planted layers before it change by less than the rule's
    # 1e-5: rounding a product that is exactly c times larger costs nothing extra)
    layer, block = _first_jump(llm, ids, fault)
    print(f"layer diff: first jump {layer} {block}; first NaN {counts.first()}; first layer "
          f"with max raw q.k x {c} > 65504: {first}")
    assert (layer, block) == (first, "self_attn")
    assert counts.first() == f"layers.{first}.self_attn"
    # a generation under the fault is reported corrupted, not sampled from NaN
    before = llm.llm_engine.stats.num_corrupted_requests
    with fault():
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))
    assert out[0].outputs[0].finish_reason == "error"
    assert llm.llm_engine.stats.num_corrupted_requests == before + 1


def test_softmax_without_max_is_nan_in_float16(fp16_llm):
    llm = fp16_llm
    ids = llm.get_tokenizer().encode(EMB_TEXT)
    _, _, scaled_max = _score_stats(llm, ids)
    first = next(i for i, m in enumerate(scaled_max) if m > math.log(65504))
    print(f"largest scaled score per layer: {[round(x, 1) for x in scaled_max]}; first "
          f"> ln(65504): layer {first}")
    with track_nonfinite(llm) as counts, faults.softmax_without_max(llm):
        rows = llm.score(ids, output="logits")
    print(f"first module with NaN/inf: {counts.first()}")
    assert not torch.isfinite(rows).all()
    assert counts.first() == f"layers.{first}.self_attn"
    # below the overflow it is not exact either: exp and the sum rounded to fp16 already
    # move layer 0 (the layer diff's first jump), though nothing overflows there
    layer, block = _first_jump(llm, ids, lambda: faults.softmax_without_max(llm))
    print(f"layer diff: first jump {layer} {block}")
    assert layer is not None and layer <= first and block == "self_attn"
