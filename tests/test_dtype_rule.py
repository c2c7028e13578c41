"""The dtype rule against vLLM's (``vllm/config/model.py``: ``_resolve_auto_dtype`` and
``_get_and_verify_dtype``, rule of PR #18751), and the residual-scale reparametrization of
chapters 10 and 12 (exact in float32 and bfloat16, overflowing float16)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import (ALLOWED_DTYPES, FLOAT16_NOT_SUPPORTED_MODELS, parse_dtype,
                             resolve_auto_dtype)
from minivllm.engine.arg_utils import EngineArgs
from minivllm.precision import metrics
from minivllm.precision.faults import residual_scale_reparam
from minivllm.precision.overflow import track_nonfinite

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU, PRE_AMPERE = [BF16, F16, F32], [F16, F32]


@pytest.mark.parametrize("config_dtype,supported,model_type,expected", [
    (F32, CPU, "llama", BF16),          # fp32 checkpoints: the platform's preferred dtype
    (F32, PRE_AMPERE, "llama", F16),    # ... float16 before Ampere (the OLMo incident's path)
    (BF16, PRE_AMPERE, "llama", F16),   # unsupported bf16: the preferred dtype, with a warning
    (F16, CPU, "llama", F16),
    (BF16, CPU, "llama", BF16),
    (F32, PRE_AMPERE, "gemma3", F32),   # float16 excluded for Gemma 3: float32 is left
    (F16, CPU, "gemma3", BF16),         # a float16 Gemma 3 checkpoint falls back to bf16
    (F32, CPU, "gemma2", BF16),
])
def test_auto_rule_as_vllm(config_dtype, supported, model_type, expected):
    assert resolve_auto_dtype(config_dtype, supported, model_type) == expected


def test_auto_rule_with_nothing_left_raises():
    with pytest.raises(ValueError, match="gemma3"):
        resolve_auto_dtype(F32, [F16], "gemma3")


@pytest.mark.parametrize("name,expected", [
    ("half", F16), ("float16", F16), ("float", F32), ("float32", F32), ("bfloat16", BF16),
    ("BFloat16", BF16), ("Half", F16), ("FLOAT32", F32), ("AUTO", BF16),  # vLLM lowercases
    (F16, F16), (BF16, BF16), (F32, F32),
])
def test_explicit_names_any_case(name, expected):
    assert parse_dtype(name, F32, "cpu") == expected


@pytest.mark.parametrize("bad", ["fp16", "bf16", "float64", "int8", "", "auto "])
def test_unknown_names_raise_and_list_the_allowed(bad):
    with pytest.raises(ValueError, match="Unknown dtype") as e:
        parse_dtype(bad, F32)
    assert all(a in str(e.value) for a in ALLOWED_DTYPES)
    with pytest.raises(ValueError, match="Unknown dtype"):
        EngineArgs(dtype=bad).validate()


def test_unsupported_torch_dtype_and_non_string_raise():
    with pytest.raises(ValueError, match="not supported"):
        parse_dtype(torch.float64, F32)
    with pytest.raises(ValueError, match="Unknown dtype"):
        EngineArgs(dtype=16).validate()
    EngineArgs(dtype="BFloat16").validate()  # any case, as vLLM


def test_float16_refused_for_gemma_types():
    for model_type in FLOAT16_NOT_SUPPORTED_MODELS:
        with pytest.raises(ValueError, match=f"{model_type}.*does not support float16"):
            parse_dtype("half", BF16, model_type=model_type)
        assert parse_dtype("bfloat16", BF16, model_type=model_type) == BF16
    assert parse_dtype("half", BF16, model_type="llama") == F16


def test_supported_override_resolves_as_a_pre_ampere_gpu():
    assert parse_dtype("auto", F32, "cpu", supported=PRE_AMPERE) == F16
    assert parse_dtype("auto", F32, "cpu", supported=[F32]) == F32


@pytest.mark.parametrize("config_dtype,name,level,text", [
    (BF16, "float16", logging.WARNING, "Casting torch.bfloat16 to torch.float16."),
    (F16, "bfloat16", logging.WARNING, "Casting torch.float16 to torch.bfloat16."),
    (F32, "auto", logging.INFO, "Downcasting torch.float32 to torch.bfloat16."),
    (BF16, "float32", logging.INFO, "Upcasting torch.bfloat16 to torch.float32."),
])
def test_cast_messages_as_vllm(caplog, config_dtype, name, level, text):
    with caplog.at_level(logging.INFO, logger="minivllm"):
        parse_dtype(name, config_dtype, "cpu")
    hits = [r for r in caplog.records if r.getMessage() == text]
    assert hits and all(r.levelno == level for r in hits), caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        parse_dtype(config_dtype, config_dtype)  # no cast: no message
    assert not caplog.records


def test_engine_warns_when_serving_a_bf16_checkpoint_in_fp16(tiny_model_dir, tmp_path, caplog,
                                                             one_thread):
    folder = tmp_path / "bf16-ckpt"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = LLM(str(folder), dtype="half", max_model_len=64)
    assert llm.llm_engine.model_config.dtype == F16
    assert "Casting torch.bfloat16 to torch.float16." in caplog.text
    assert LLM(str(folder), max_model_len=64).llm_engine.model_config.dtype == BF16  # auto


# --- the residual-scale reparametrization ------------------------------------------------

IDS = [[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 31, 2]]


def _peak_and_logits(llm, c):
    peak = []
    model = llm.llm_engine.model_runner.model
    hook = model.layers[-1].register_forward_hook(
        lambda m, a, out: peak.append(float(out.float().abs().max())))
    try:
        with residual_scale_reparam(llm, c), track_nonfinite(llm) as counts:
            rows = llm.score(IDS, output="logits")[0]
    finally:
        hook.remove()
    return max(peak), rows, counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_power_of_two_scale_is_exact_below_overflow(tiny_model_dir, one_thread, dtype):
    llm = LLM(str(tiny_model_dir), dtype=dtype, max_model_len=64)
    base = llm.score(IDS, output="logits")[0]
    peak1, same, _ = _peak_and_logits(llm, 1)
    peak4, rows, counts = _peak_and_logits(llm, 4)
    assert torch.equal(same, base)
    # powers of two only move exponents: the logits are bit for bit those of the model
    diff = float((rows - base).abs().max())
    print(f"{dtype}: residual peak {peak1:.3g} -> {peak4:.3g}, max |dlogit| {diff:.3g}")
    assert peak4 == pytest.approx(4 * peak1, rel=1e-2)
    assert torch.equal(rows, base), f"{dtype}: max |dlogit| {diff}"
    assert counts.total() == 0


def test_non_power_of_two_scale_is_exact_up_to_rounding(tiny_model_dir, one_thread):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    base = llm.score(IDS, output="logits")[0]
    _, rows, _ = _peak_and_logits(llm, 3.0)
    kl = float(metrics.kl_divergence(base, rows).mean())
    print(f"c=3, float32: KL {kl:.3g} nats")
    assert kl < 1e-9  # the float32 noise floor is ~1e-11 nats on SmolLM2


def test_overflow_in_fp16_only_and_reported(tiny_model_dir, one_thread):
    ref = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    peak, _, _ = _peak_and_logits(ref, 1)
    c = 2.0 ** (int(torch.log2(torch.tensor(65504.0 / peak)).ceil()) + 1)  # peak * c > 65504
    bf16 = LLM(str(tiny_model_dir), dtype="bfloat16", max_model_len=64)
    _, rows, counts = _peak_and_logits(bf16, c)
    assert counts.total() == 0 and bool(torch.isfinite(rows).all())
    fp16 = LLM(str(tiny_model_dir), dtype="float16", max_model_len=64)
    _, rows, counts = _peak_and_logits(fp16, c)
    assert counts.first() is not None and not bool(torch.isfinite(rows).all())
    print(f"tiny model: peak {peak:.3g}, c={c:g}: fp16 non-finite first at {counts.first()}")
    with residual_scale_reparam(fp16, c):
        out = fp16.generate([[5, 17, 42]], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].outputs[0].finish_reason == "error"
    assert fp16.llm_engine.stats.num_corrupted_requests >= 1
    # restored on exit
    out = fp16.generate([[5, 17, 42]], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].outputs[0].finish_reason == "length"


def test_reparam_rejects_bad_scales(tiny_model_dir, one_thread):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    for bad in (0, -2.0, float("inf"), float("nan"), True, "4"):
        with pytest.raises(ValueError, match="c must be"):
            with residual_scale_reparam(llm, bad):
                pass
    with pytest.raises(TypeError):
        with residual_scale_reparam(llm.llm_engine, 4):
            pass
