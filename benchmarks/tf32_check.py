"""TF32 on a real GPU against the CPU emulation, and the numerics features on CUDA.

Needs a CUDA device. Part 1 multiplies random float32 matrices four ways (float64 exact;
float32; real TF32 on the GPU; the emulation: inputs rounded to TF32 by
``minivllm.numerics.round_to_tf32``, then a float32 matmul on the GPU) and reports each
one's error against float64. Part 2 runs a random Llama (Llama-shaped, small, built on
the fly; nothing to download) through the engine on CUDA in float32 with
``float32_matmul_precision`` "highest" and "high", then with each weight-quantization
method, KV int8 dynamic scales and calibrated fp8 scales, and reports the KL of each
against float32 (so the GPU path of every feature is exercised).

Prints a table and, as its last line, one JSON object.

    python benchmarks/tf32_check.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


def matmul_errors(n: int = 1024, k: int = 4096, seed: int = 0) -> dict:
    from minivllm.numerics import round_to_tf32

    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, k, generator=g), torch.randn(k, n, generator=g)
    exact = (a.double() @ b.double())
    scale = (a.double().abs() @ b.double().abs())  # error bound's natural scale
    out = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    out["float32 (cuda)"] = (a.cuda() @ b.cuda()).cpu()
    torch.backends.cuda.matmul.allow_tf32 = True
    out["tf32 (cuda, real)"] = (a.cuda() @ b.cuda()).cpu()
    torch.backends.cuda.matmul.allow_tf32 = False
    out["tf32 (emulated: rounded inputs, float32 matmul)"] = \
        (round_to_tf32(a).cuda() @ round_to_tf32(b).cuda()).cpu()
    res = {name: float(((y.double() - exact).abs() / scale).mean()) for name, y in out.items()}
    real, emu = out["tf32 (cuda, real)"], out["tf32 (emulated: rounded inputs, float32 matmul)"]
    res["real vs emulated: mean rel diff"] = float(((real - emu).double().abs() / scale).mean())
    return res


def engine_checks() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_model import make_tiny_llama

    from minivllm import LLM

    d = make_tiny_llama(Path(tempfile.mkdtemp()), num_layers=4, hidden_size=256, num_heads=8,
                        num_kv_heads=2, intermediate_size=512)
    ids = [list(range(3, 200)), list(range(200, 380))]
    common = dict(device="cuda", max_model_len=512, num_gpu_blocks_override=64)
    ref = LLM(str(d), dtype="float32", **common).score(ids)

    def kl(**kw) -> float:
        rows = LLM(str(d), **{"dtype": "float32", **common, **kw}).score(ids)
        return float(sum((r.exp() * (r - c)).sum(-1).mean() for r, c in zip(ref, rows)) / len(ids))

    calib = {"calibration": "corpus", "calibration_tokens": 256}
    configs = {
        "tf32 (float32_matmul_precision=high)": dict(float32_matmul_precision="high"),
        "bfloat16": dict(dtype="bfloat16"),
        "int8 weights": dict(quantization="int8"),
        "int4 rtn g64": dict(quantization="int4", quantization_config={"group_size": 64}),
        "awq g64": dict(quantization="awq", quantization_config={"group_size": 64, **calib}),
        "gptq g64": dict(quantization="gptq", quantization_config={"group_size": 64, **calib}),
        "fp8 w8a8 dynamic": dict(quantization="fp8"),
        "kv int8 dynamic": dict(kv_cache_dtype="int8", kv_scale_type="dynamic"),
        "kv fp8_e4m3 calibrated per head": dict(kv_cache_dtype="fp8_e4m3",
                                                calculate_kv_scales=True,
                                                kv_scale_granularity="head"),
    }
    out = {name: kl(**kw) for name, kw in configs.items()}
    torch.set_float32_matmul_precision("highest")  # the engine switch is process-wide
    return out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this check needs a CUDA device")
    mm = matmul_errors()
    eng = engine_checks()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| matmul [1024 x 4096] @ [4096 x 1024] | mean |err| / (|A||B|) |\n|---|---|")
    for name, v in mm.items():
        print(f"| {name} | {v:.3g} |")
    print("| engine on CUDA (random Llama, 4 layers) | mean KL vs float32 (nats) |\n|---|---|")
    for name, v in eng.items():
        print(f"| {name} | {v:.3g} |")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "matmul": mm, "engine_kl": eng}))


if __name__ == "__main__":
    main()
