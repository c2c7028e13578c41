"""Group-wise int8 (weight_quant.quantize_int8_group) and the exact SmoothQuant fold
(quantization/smoothing.py)."""

import pytest
import torch

from minivllm.quantization import smoothing as sm
from minivllm.quantization import weight_quant as wq


def test_int8_group_formula_ties_zero_groups_and_short_group():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=g)
    w[1, 4:8] = 0                                        # an all-zero group (g = 4)
    w[2, :4] = torch.tensor([0.5, -1.5, 2.5, 127.0])     # scale 1: exact .5 ties
    q, s = wq.quantize_int8_group(w, 4)
    assert q.dtype == torch.int8 and s.shape == (6, 3) and s.dtype == torch.float32
    assert float(s[1, 1]) == 1.0 and q[1, 4:8].tolist() == [0, 0, 0, 0]
    assert q[2, :4].tolist() == [0, -2, 2, 127]          # half to even
    # the short last group (columns 8-9) has its own scale
    assert torch.equal(s[:, 2], w[:, 8:].abs().amax(1) / 127)
    ref = torch.cat([torch.round(w[:, k:k + 4] / s[:, k // 4:k // 4 + 1]) for k in (0, 4, 8)], 1)
    assert torch.equal(q.float(), ref.clamp(-127, 127))
    back = wq.dequantize_int8_group(q, s, 4)
    step = s.repeat_interleave(4, 1)[:, :10]
    assert bool(((back - w).abs() <= step / 2 + 1e-7).all())


def test_int8_group_as_wide_as_the_row_is_per_channel():
    w = torch.randn(7, 33, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = wq.quantize_int8_group(w, 33)
    qc, sc = wq.quantize_int8(w, "channel")
    assert torch.equal(q, qc) and torch.equal(s, sc)
    assert torch.equal(wq.dequantize_int8_group(q, s, 33), wq.dequantize_int8(qc, sc))


def test_int8_group_errors():
    with pytest.raises(ValueError):
        wq.quantize_int8_group(torch.ones(2, 4), 0)
    with pytest.raises(ValueError):
        wq.dequantize_int8_group(torch.ones(2, 4, dtype=torch.int8), torch.ones(2, 1), 2)


def test_smoothing_scales_formula_and_powers_of_two():
    x = torch.tensor([8.0, 0.5, 1e-9, 3.0])
    w = torch.tensor([0.5, 2.0, 0.1, 1.0])
    s = sm.smoothing_scales(x, w, 0.5)
    raw = (x.clamp(min=1e-5).sqrt() / w.sqrt())
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(raw))))
    assert s.tolist()[:2] == [4.0, 0.5]
    assert torch.equal(sm.smoothing_scales(x, w, 0.0), sm.power_of_two(1 / w))
    with pytest.raises(ValueError):
        sm.smoothing_scales(x, w, 1.5)
    with pytest.raises(ValueError):
        sm.smoothing_scales(x, w[:3], 0.5)


def test_fold_is_exact_and_moves_the_range_into_the_weights(tmp_path):
    from minivllm import LLM
    from minivllm.models.loader import resolve_model_path
    from minivllm.quantization.quantize import target_layers

    common = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
    base = LLM("smollm2-135m-instruct", **common)
    seq = [base.get_tokenizer().encode("The folded model computes the same numbers.")]
    amax = sm.input_amax(base, seq)
    assert len(amax) == 60 and amax["layers.0.self_attn.qkv_proj"].shape == (576,)
    layers = target_layers(base.llm_engine.model_runner.model)
    names = ["layers.3.self_attn.qkv_proj", "layers.7.mlp.gate_up_proj"]
    scales = {n: sm.smoothing_scales(amax[n], layers[n].weight.detach().abs().amax(0), 1.0) for n in names}
    assert all(float(s.max() / s.min()) > 4 for s in scales.values())
    out = sm.fold_into_checkpoint(resolve_model_path("smollm2-135m-instruct"), tmp_path / "f",
                                  scales)
    folded = LLM(str(out), **common)
    a = base.score(seq, output="logits")[0]
    b = folded.score(seq, output="logits")[0]
    assert torch.equal(a, b)                             # the reparametrization is exact
    fl = target_layers(folded.llm_engine.model_runner.model)
    for n in names:
        assert torch.equal(fl[n].weight, layers[n].weight * scales[n])
    assert torch.equal(fl["layers.4.self_attn.qkv_proj"].weight,
                       layers["layers.4.self_attn.qkv_proj"].weight)
    with pytest.raises(ValueError):
        sm.fold_into_checkpoint(resolve_model_path("smollm2-135m-instruct"), tmp_path / "g",
                                {names[0]: scales[names[0]] * 1.5})
    with pytest.raises(ValueError):
        sm.fold_into_checkpoint(resolve_model_path("smollm2-135m-instruct"), tmp_path / "h",
                                {"layers.3.mlp.down_proj": scales[names[0]]})
