"""Chapter 11's engine parts: rope scaling (linear, dynamic, llama3, yarn) checked against
transformers' own ``ROPE_INIT_FUNCTIONS`` and ``LlamaRotaryEmbedding``; ``hf_overrides``
(dict or callable) applied to the config before the model is built, checked against HF
transformers loading the same edit from config.json; the planted RoPE faults (a 16-bit
table, a wrong theta in every layer) and what finds them. Expected values come from
transformers, from float64 arithmetic written out here, or from the engine's clean runs.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from minivllm import LLM
from minivllm.layers.rotary_embedding import (normalize_rope_scaling, rope_inv_freq,
                                              rope_table_ref)
from minivllm.precision import faults, metrics
from minivllm.precision.layer_diff import layer_diff

pytestmark = pytest.mark.usefixtures("one_thread")

# Float32 tolerance for tables and inverse frequencies: both sides compute the same float32
# operations, so they are expected to agree to a few units in the last place; 4 ulp of
# float32 relative (2**-21 ~ 4.8e-7) is allowed for inv_freq, and 4 ulp of the largest
# angle for cos/sin (an angle of a few thousand radians carries ~2.4e-4 of rounding).
INV_FREQ_RTOL = 2.0 ** -21

SCALINGS = [
    ("linear", {"factor": 2.0}, 64, 10000.0, 2048),
    ("linear", {"factor": 0.5}, 128, 500000.0, 8192),
    ("dynamic", {"factor": 4.0}, 64, 100000.0, 2048),
    ("dynamic", {"factor": 2.5}, 96, 10000.0, 4096),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 128, 500000.0, 131072),
    ("llama3", {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024}, 64, 100000.0, 8192),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 1024}, 64, 50000.0, 4096),
    ("yarn", {"factor": 16.0, "original_max_position_embeddings": 2048, "beta_fast": 16,
              "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}, 128, 10000.0, 32768),
    ("yarn", {"factor": 2.0, "original_max_position_embeddings": 4096, "truncate": False,
              "attention_factor": 1.25}, 64, 1000000.0, 8192),
]


def _hf_config(rope_type, fields, head_dim, theta, max_pos):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_pos,
                       rope_parameters={"rope_type": rope_type, "rope_theta": theta, **fields})


def _ours(rope_type, fields, max_pos):
    return normalize_rope_scaling({"rope_type": rope_type, **fields}, max_pos)


@pytest.mark.parametrize("rope_type,fields,head_dim,theta,max_pos", SCALINGS)
def test_inv_freq_matches_transformers(rope_type, fields, head_dim, theta, max_pos):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf_config(rope_type, fields, head_dim, theta, max_pos)
    # dynamic: vLLM's fixed table is transformers' at seq_len = factor * L0
    seq_len = int(fields["factor"] * max_pos)
    want, want_af = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
    got, got_af = rope_inv_freq(head_dim, theta, _ours(rope_type, fields, max_pos))
    assert got.dtype == torch.float32 and got.shape == want.shape == (head_dim // 2,)
    rel = ((got.double() - want.double()).abs() / want.double().abs()).max().item()
    print(f"{rope_type} {fields}: max relative inv_freq error {rel:.2e} (tol {INV_FREQ_RTOL:.1e}), "
          f"attention factor {got_af} vs {want_af}")
    assert rel <= INV_FREQ_RTOL
    assert math.isclose(got_af, float(want_af), rel_tol=1e-12)
    # the scaling did something (a test of a no-op would pass for a wrong no-op too)
    plain, _ = rope_inv_freq(head_dim, theta, None)
    assert not torch.equal(got, plain) or got_af != 1.0


@pytest.mark.parametrize("rope_type,fields,head_dim,theta,max_pos",
                         [s for s in SCALINGS if s[0] != "dynamic"])
def test_table_matches_transformers_rotary_embedding(rope_type, fields, head_dim, theta, max_pos):
    """cos/sin rows against ``LlamaRotaryEmbedding.forward`` (yarn's attention factor
    included). Dynamic is left out: transformers recomputes it from each call's length."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rows = min(max_pos, 6000)
    pos = torch.tensor([0, 1, 2, 255, 256, 257, 1023, 1857, rows - 2, rows - 1])
    hf = LlamaRotaryEmbedding(_hf_config(rope_type, fields, head_dim, theta, max_pos))
    want_cos, want_sin = hf(torch.zeros(1, len(pos), head_dim), pos[None])
    cos, sin = rope_table_ref(head_dim, rows, theta, _ours(rope_type, fields, max_pos))
    assert cos.shape == (rows, head_dim) and cos.dtype == torch.float32
    err = max((cos[pos] - want_cos[0]).abs().max().item(),
              (sin[pos] - want_sin[0]).abs().max().item())
    tol = 4 * torch.finfo(torch.float32).eps * rows  # 4 ulp of the largest angle
    print(f"{rope_type}: max |cos/sin - transformers| {err:.2e} (tol {tol:.1e})")
    assert err <= tol


def test_default_table_unchanged_and_exact_in_float64():
    """No scaling: the table equals float64 cos/sin of the float32 angles (the float32
    angle is the only rounding), so the default path keeps its numbers."""
    cos, sin = rope_table_ref(64, 2000, 100000.0)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    ang = torch.outer(torch.arange(2000).float(), inv).double()
    err = (cos.double() - torch.cat([ang, ang], -1).cos()).abs().max().item()
    print(f"default table vs float64 cos of the same angles: {err:.2e} (tol 1e-6)")
    assert err < 1e-6


@pytest.mark.parametrize("scaling,pattern", [
    ({"rope_type": "su", "factor": 2.0}, r"type 'su' is not supported \(supported: default, "
                                          r"linear, dynamic, llama3, yarn\)"),
    ({"type": "longrope", "short_factor": [1.0]}, r"type 'longrope' is not supported"),
    ({"rope_type": "linear"}, r"needs the field\(s\) \['factor'\]"),
    ({"rope_type": "linear", "factor": -2.0}, r"rope_scaling\['factor'\] must be a positive"),
    ({"rope_type": "linear", "factor": "2"}, r"rope_scaling\['factor'\] must be a positive"),
    ({"rope_type": "dynamic", "factor": 0.5}, r"needs factor >= 1"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     r"needs the field\(s\) \['high_freq_factor', 'original_max_position_embeddings'\]"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, r"high_freq_factor > low_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, r"'truncate'\] must be True or"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     r"partial_rotary_factor 0.5 is not supported"),
    ([("rope_type", "linear")], r"rope_scaling must be a dict or None"),
])
def test_bad_rope_scaling_is_refused(scaling, pattern):
    with pytest.raises(ValueError, match=pattern):
        normalize_rope_scaling(scaling, 2048)


def test_default_and_empty_scaling_are_no_scaling():
    assert normalize_rope_scaling(None) is None
    assert normalize_rope_scaling({}) is None
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 1e4}) is None
    # the pre-4.45 spelling "type", and dynamic's L0 from max_position_embeddings
    assert normalize_rope_scaling({"type": "dynamic", "factor": 2.0}, 4096) == {
        "rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096}


# --- hf_overrides on the engine (tiny random Llama: head_dim 16, theta 1e4, 512 positions)

IDS = torch.randint(0, 380, (300,), generator=torch.Generator().manual_seed(11)).tolist()
LINEAR = {"rope_type": "linear", "factor": 2.0}


def _llm(path, **kw):
    return LLM(str(path), dtype="float32", seed=0, **kw)


def _variant(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    cfg.pop("rope_parameters", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_hf_overrides_rope_scaling_matches_transformers_reading_it(tiny_model_dir, tmp_path):
    """The override gives the numbers transformers gives for the same field in
    config.json, and max_model_len grows by the factor, as vLLM derives it."""
    from minivllm.precision.reference import ReferenceModel

    llm = _llm(tiny_model_dir, hf_overrides={"rope_scaling": LINEAR})
    assert llm.llm_engine.model_config.max_model_len == 512 * 2
    ref = ReferenceModel(str(_variant(tiny_model_dir, tmp_path / "lin", rope_scaling=LINEAR)))
    got, want = llm.score(IDS, output="logits"), ref.score(IDS).float()
    plain = _llm(tiny_model_dir, max_model_len=512).score(IDS, output="logits")
    kl = metrics.mean_kl(want, got)
    kl_plain = metrics.mean_kl(want, plain)
    print(f"linear x2 via hf_overrides vs HF with it in config.json: KL {kl:.2e}; "
          f"the unscaled engine: {kl_plain:.2e}")
    assert kl < 1e-9 < 1e-4 < kl_plain


def test_hf_overrides_theta_equals_the_all_layer_fault_and_a_callable(tiny_model_dir):
    clean = _llm(tiny_model_dir)
    rows_clean = clean.score(IDS, output="logits")
    with faults.wrong_rope_theta(clean, None, 500.0):
        rows_fault = clean.score(IDS, output="logits")
    rows_dict = _llm(tiny_model_dir, hf_overrides={"rope_theta": 500.0}).score(IDS, output="logits")

    def set_theta(cfg):
        cfg["rope_theta"] = 500.0
        return cfg

    rows_fn = _llm(tiny_model_dir, hf_overrides=set_theta).score(IDS, output="logits")
    assert torch.equal(rows_dict, rows_fault) and torch.equal(rows_fn, rows_dict)
    assert not torch.equal(rows_dict, rows_clean)
    assert torch.equal(clean.score(IDS, output="logits"), rows_clean)  # restored


def test_hf_overrides_max_position_embeddings(tiny_model_dir):
    llm = _llm(tiny_model_dir, hf_overrides={"max_position_embeddings": 128})
    assert llm.llm_engine.model_config.max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len=256 exceeds .*=128"):
        _llm(tiny_model_dir, hf_overrides={"max_position_embeddings": 128}, max_model_len=256)


@pytest.mark.parametrize("overrides,pattern", [
    ("rope_theta=500", r"hf_overrides must be None, a dict of config fields or a callable"),
    ({1: 2}, r"hf_overrides must be None, a dict"),
    (lambda cfg: None, r"hf_overrides: the callable must return the config dict, got NoneType"),
    ({"rope_scaling": {"rope_type": "ntk", "factor": 2.0}},
     r"rope_scaling type 'ntk' is not supported \(supported: default, linear"),
    ({"rope_scaling": {"rope_type": "yarn"}}, r"needs the field\(s\) \['factor'\]"),
    ({"rope_theta": 0}, r"'rope_theta' must be a positive number"),
    ({"rope_scaling": "linear"}, r"'rope_scaling' must be an object or null"),
])
def test_bad_hf_overrides_are_refused(tiny_model_dir, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        _llm(tiny_model_dir, hf_overrides=overrides)


def test_a_swapped_table_keeps_the_models_scaling(tiny_model_dir):
    """The "rotary.table" step hands a scaled model's ``rope_scaling`` to the swapped
    function: the reference swapped in gives the same rows; three-argument functions
    (which cannot take it) are refused with TypeError on a scaled model."""
    from minivllm.steps import reference

    llm = _llm(tiny_model_dir, hf_overrides={"rope_scaling": LINEAR}, max_model_len=512)
    want = llm.score(IDS[:64], output="logits")
    seen = []

    def spy(head_dim, max_position, base, rope_scaling=None):
        seen.append(rope_scaling)
        return reference("rotary.table")(head_dim, max_position, base, rope_scaling)

    with llm.swap_step("rotary.table", spy):
        assert torch.equal(llm.score(IDS[:64], output="logits"), want)
    assert seen == [LINEAR]
    with pytest.raises(TypeError):
        with llm.swap_step("rotary.table", lambda d, m, b: rope_table_ref(d, m, b)):
            pass


# --- the planted faults --------------------------------------------------------------------

def test_low_precision_table_stages_against_float64():
    """bf16 positions are exact up to 256 and wrong from 257 (257 -> 256); computed
    angles grow wrong with position; values stored in bf16 stay within bf16's rounding."""
    ref_cos, _ = rope_table_ref(64, 2048, 100000.0)
    errs = {}
    for stage in faults.ROPE_TABLE_STAGES:
        cos, sin = faults.rope_table_low_precision(64, 2048, 100000.0, dtype=torch.bfloat16,
                                                   stage=stage)
        assert cos.dtype == torch.float32 and cos.shape == (2048, 64)
        errs[stage] = (cos - ref_cos).abs().amax(-1)
    print({k: (f"{v[:257].max():.1e}", f"{v[257:].max():.1e}") for k, v in errs.items()})
    assert errs["positions"][:257].max() == 0 and errs["positions"][257] > 0.1
    assert torch.bfloat16 and float(torch.tensor(257.0).bfloat16()) == 256.0
    assert errs["angles"][1024:].max() > 0.5 > errs["angles"][:8].max()
    assert errs["values"].max() <= 2.0 ** -9  # half a bf16 ulp of a value in [0.5, 1]
    with pytest.raises(ValueError, match="stage must be one of"):
        faults.rope_table_low_precision(64, 8, 1e4, stage="cos")
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        faults.rope_table_low_precision(64, 8, 1e4, dtype=torch.float64)


def test_bf16_position_table_exact_below_257_then_wrong_on_the_engine(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    clean = llm.score(IDS, output="logits")
    with faults.low_precision_rope_table(llm, torch.bfloat16, stage="positions"):
        bad = llm.score(IDS, output="logits")
    assert torch.equal(bad[:257], clean[:257])
    kl = metrics.kl_divergence(clean[257:], bad[257:])
    print(f"bf16 positions: KL at 257..299 mean {kl.mean():.2e}, max {kl.max():.2e}")
    assert kl.max() > 1e-4
    assert torch.equal(llm.score(IDS, output="logits"), clean)  # restored


def test_layer_diff_finds_an_all_layer_rope_fault_at_layer_0(tiny_model_dir):
    """A fault in every layer's table shows first where the table is first used: layer
    0's attention (the layer diff against HF float32)."""
    from minivllm.precision.reference import ReferenceModel

    llm = _llm(tiny_model_dir, max_model_len=512)
    ref = ReferenceModel(str(tiny_model_dir))
    assert layer_diff(llm, ref, IDS).first_jump_layer is None
    for fault in (lambda: faults.wrong_rope_theta(llm, None, 500.0),
                  lambda: faults.low_precision_rope_table(llm, torch.bfloat16, "angles")):
        with fault():
            d = layer_diff(llm, ref, IDS)
        assert (d.first_jump_layer, d.first_jump_block) == (0, "self_attn"), d.to_markdown()


def test_fault_arguments_are_checked(tiny_model_dir):
    llm = _llm(tiny_model_dir, max_model_len=64)
    with pytest.raises(ValueError, match="theta must be > 0"):
        with faults.wrong_rope_theta(llm, None, -1.0):
            pass
    with pytest.raises(ValueError, match="layer must be in"):
        with faults.low_precision_rope_table(llm, layer=7):
            pass
    with pytest.raises(ValueError, match="stage must be one of"):
        with faults.low_precision_rope_table(llm, stage="table"):
            pass
