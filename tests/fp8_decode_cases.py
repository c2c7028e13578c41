"""Random fp8 decode cases and the error measure of the fp8 decode contract.

Shared by ``tests/test_kernels.py`` (the contract's bounds) and
``benchmarks/fp8_decode.py`` (the table of errors, on CPU and GPU). The error of a row
is ``max |out - truth| / max |V|`` over that row's keys, where the truth is
:func:`minivllm_kernels.paged_attention.paged_attention_decode_f64` (attention in float64
of the dequantized cache): the output is a convex combination of the V rows, so this is
the error relative to the largest value it can reach. Divided by the query dtype's unit
roundoff u (``UNIT_ROUNDOFF``) it reads in ulps.
"""

from __future__ import annotations

import torch

from minivllm_kernels import paged_attention as PA
from minivllm_kernels.reference import quantize_kv

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def random_case(B: int, lens: list[int], H: int, Hkv: int, D: int, bs: int, cache_dtype,
                q_dtype, mode: str, device: str, g: torch.Generator) -> dict:
    """A paged fp8 cache with random K/V (heads of different ranges, a few large keys),
    its block tables (blocks in random order) and scales: "head" (per-head static scales,
    amax / qmax times a factor that is not a power of two) or "dynamic" (per token)."""
    blocks = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(blocks) + 3, generator=g).to(device)
    bt = torch.zeros(B, max(blocks), dtype=torch.int32, device=device)
    i = 0
    for b, nb in enumerate(blocks):
        bt[b, :nb] = perm[i:i + nb]
        i += nb
    num_slots = (sum(blocks) + 3) * bs
    rng = torch.linspace(0.5, 3.0, Hkv)[:, None]
    k = torch.randn(num_slots, Hkv, D, generator=g) * rng
    k[torch.rand(num_slots, generator=g) < 0.01] *= 6  # a few keys that dominate
    v = torch.randn(num_slots, Hkv, D, generator=g) * rng.flip(0)
    fmax = torch.finfo(cache_dtype).max
    kw: dict = {}
    if mode == "head":
        ks = k.abs().amax(dim=(0, 2)) / fmax * 1.37
        vs = v.abs().amax(dim=(0, 2)) / fmax * 1.37
        kc = quantize_kv(k, cache_dtype, ks[None, :, None])
        vc = quantize_kv(v, cache_dtype, vs[None, :, None])
        kw = dict(k_scale=ks.to(device), v_scale=vs.to(device))
    else:
        ks = k.abs().amax(dim=2) / fmax
        vs = v.abs().amax(dim=2) / fmax
        kc = quantize_kv(k, cache_dtype, ks[..., None])
        vc = quantize_kv(v, cache_dtype, vs[..., None])
        kw = dict(k_scale_cache=ks.float().to(device), v_scale_cache=vs.float().to(device))
    q = torch.randn(B, H, D, generator=g).to(device, q_dtype)
    return dict(q=q, key_cache=kc.to(device), value_cache=vc.to(device), block_tables=bt,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_size=bs,
                scale=D ** -0.5, **kw)


def normalized_error(out: torch.Tensor, truth: torch.Tensor, case: dict) -> float:
    """max over rows of max |out - truth| / max |V| (V of that row's sequence and KV head,
    dequantized in float64), in units of nothing: divide by u for ulps."""
    vmax = []
    H, Hkv = case["q"].shape[1], case["key_cache"].shape[1]
    for b in range(out.shape[0]):
        vals = _dequant_v(case, b, max(int(case["seq_lens"][b]), 1))  # [n, Hkv, D] float64
        vmax.append(vals.abs().amax(dim=(0, 2)).repeat_interleave(H // Hkv))  # [H]
    denom = torch.stack(vmax).clamp(min=1e-30)  # [B, H]
    err = (out.double() - truth).abs().amax(dim=-1) / denom
    return float(err.max())


def _dequant_v(case: dict, b: int, n: int) -> torch.Tensor:
    """Sequence b's first n values, dequantized in float64: [n, Hkv, D]."""
    return PA.gather_kv(case["value_cache"], case["block_tables"][b], case["block_size"], n,
                        torch.float64, case.get("v_scale", 1.0), case.get("v_scale_cache"))


def float_cache_case(case: dict) -> dict:
    """The same dequantized values in a cache of q's dtype (no scales)."""
    out = {k: v for k, v in case.items() if k not in ("k_scale", "v_scale", "k_scale_cache",
                                                       "v_scale_cache")}
    for name, s, sc in (("key_cache", "k_scale", "k_scale_cache"),
                        ("value_cache", "v_scale", "v_scale_cache")):
        raw = case[name].view(torch.uint8).cpu().view(case[name].dtype).float()
        scale = case[sc].cpu()[..., None] if sc in case else case[s].cpu()[None, :, None]
        out[name] = (raw * scale).to(case["q"].device, case["q"].dtype)
    return out


def errors(device: str, seeds: int) -> list[dict]:
    rows = []
    H, Hkv, D, bs = 8, 2, 128, 16
    lens = [1, 17, 530, 1300]
    for q_name, q_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                            ("float32", torch.float32)):
        for fmt, cache_dtype in FP8.items():
            for mode in ("head", "dynamic"):
                worst = {**{k: 0.0 for k in PA.FP8_KERNELS}, "float cache": 0.0}
                for seed in range(seeds):
                    g = torch.Generator().manual_seed(1000 * seed + 7)
                    case = random_case(len(lens), lens, H, Hkv, D, bs, cache_dtype, q_dtype,
                                       mode, device, g)
                    truth = PA.paged_attention_decode_f64(**case)
                    for name in PA.FP8_KERNELS:
                        out = PA.paged_attention_decode(**case, fp8_kernel=name)
                        worst[name] = max(worst[name], normalized_error(out, truth, case))
                    out = PA.paged_attention_decode(**float_cache_case(case))
                    worst["float cache"] = max(worst["float cache"],
                                               normalized_error(out, truth, case))
                u = UNIT_ROUNDOFF[q_dtype]
                row = dict(q_dtype=q_name, cache=fmt, scales=mode, seeds=seeds,
                           **{f"{k} / u": v / u for k, v in worst.items()},
                           folded_over_float_cache=worst["folded"] / max(worst["float cache"],
                                                                        1e-300))
                rows.append(row)
                print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items()), flush=True)
    return rows


