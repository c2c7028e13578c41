"""Chapter 13 on a real GPU: how TF32 rounds there, and 3xTF32 on tensor cores.

Needs CUDA (the chapter notebook shows this script's recorded output; it does not run
it). Four measurements, all with plain PyTorch:

1. pytorch #53635: ``[1024.5] @ I`` with TF32 off and on, at a few sizes.
   Then subnormal inputs (kept or flushed?), and the accumulation alone: inputs that
   are already TF32, summed by tensor cores and by float32 units.
2. Which rounding the GPU's TF32 matmul applies to its inputs: ``X @ I`` and ``I @ X``
   with TF32 on (every product is ``x * 1`` and every sum adds zeros, so the result is
   exactly the rounded input) compared bit for bit with three roundings of X computed
   on the CPU: ties to even (``minivllm.numerics.round_to_tf32``), ties away from zero,
   and truncation (low 13 bits dropped). X holds random finite float32 values, a
   quarter of them exact TF32 ties.
3. Error against float64 of a ``[1024 x 4096] @ [4096 x 1024]`` product (mean
   ``|err| / (|A||B|)``, as ``benchmarks/tf32_check.py``): float32, real TF32, TF32
   emulated by rounding the inputs, and 3xTF32 (each operand split into TF32 hi + lo,
   ``a_lo@b_hi + a_hi@b_lo + a_hi@b_hi``, each product a real TF32 matmul).
4. Speed of an 8192^3 product in float32, TF32 and 3xTF32 (TFLOP/s counting one
   product's 2 n^3 flops; median of 5 after 2 warm-ups).

    python course/ch13_tf32/gpu_tf32.py

Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minivllm.numerics import round_to_tf32  # noqa: E402


def rna(x: torch.Tensor) -> torch.Tensor:
    b = x.contiguous().view(torch.int32)
    special = (b & 0x7F800000) == 0x7F800000
    return torch.where(special, b, (b + 0x1000) & ~0x1FFF).view(torch.float32)


def trunc(x: torch.Tensor) -> torch.Tensor:
    b = x.contiguous().view(torch.int32)
    special = (b & 0x7F800000) == 0x7F800000
    return torch.where(special, b, b & ~0x1FFF).view(torch.float32)


def tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on


def issue_53635() -> dict:
    """``X @ I`` with X[0, 0] = 1024.5 (a TF32 tie: 1024 and 1025 are the neighbours),
    X of shape [m, n]: m = 1 is the report's vector; cuBLAS may use a non-tensor-core
    kernel there."""
    out = {}
    for m, n in ((1, 1), (1, 4096), (16, 16), (256, 256), (4096, 4096)):
        x = torch.zeros(m, n, device="cuda")
        x[0, 0] = 1024.5
        eye = torch.eye(n, device="cuda")
        for on in (False, True):
            tf32(on)
            out[f"[{m}x{n}] @ I, tf32 {'on' if on else 'off'}"] = float((x @ eye)[0, 0])
    tf32(False)
    return out


def rounding_fingerprint(rows: int = 512, n: int = 1024, seed: int = 0, tag: str = "") -> dict:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**31, (rows, n), generator=g, dtype=torch.int64)
    bits = bits.clamp(max=0x7F7FFFFF - 0x2000)  # finite, no rounding to inf
    sign = torch.randint(0, 2, (rows, n), generator=g, dtype=torch.int64) << 31
    tie = torch.rand(rows, n, generator=g) < 0.25
    bits = torch.where(tie, (bits & ~0x1FFF) | 0x1000, bits)
    bits = bits | sign
    x = bits.to(torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(x.abs() < 1e-30, torch.ones_like(x), x)  # keep products normal
    x = torch.where(x.abs() > 1e30, torch.ones_like(x), x)
    refs = {"ties to even (rne)": round_to_tf32(x), "ties away (rna)": rna(x),
            "truncate": trunc(x)}
    is_tie = (x.view(torch.int32) & 0x1FFF) == 0x1000
    out = {f"{tag}elements": x.numel(), f"{tag}exact ties": int(is_tie.sum())}
    tf32(True)
    eye = torch.eye(n, device="cuda")
    y_a = (x.cuda() @ eye).cpu()                  # X is the A operand
    y_b = (torch.eye(rows, device="cuda") @ x.cuda()).cpu()  # X is the B operand
    tf32(False)
    for name, y in (("A", y_a), ("B", y_b)):
        yb = y.view(torch.int32)
        for ref_name, r in refs.items():
            same = yb == r.view(torch.int32)
            out[f"{tag}{name} operand: bit-equal to {ref_name}"] = float(same.float().mean())
            out[f"{tag}{name} operand: bit-equal to {ref_name}, on ties"] = \
                float(same[is_tie].float().mean())
    return out


def subnormals(n: int = 256, seed: int = 0) -> dict:
    """float32 subnormal inputs times I: kept (rounded) or flushed to zero?"""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 0x7FFFFF, (n, n), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)  # positive subnormals
    eye = torch.eye(n, device="cuda")
    out = {}
    for on in (False, True):
        tf32(on)
        y = (x.cuda() @ eye).cpu()
        out[f"tf32 {'on' if on else 'off'}: fraction flushed to 0"] = float((y == 0).float().mean())
        out[f"tf32 {'on' if on else 'off'}: bit-equal to round_to_tf32"] = float(
            (y.view(torch.int32) == round_to_tf32(x).view(torch.int32)).float().mean())
    tf32(False)
    return out


def accumulation(seed: int = 0) -> dict:
    """Inputs already TF32 (so no input rounding anywhere): what is left is how the
    products are summed. Mean |err| / (|A||B|) and the mean signed error relative to the
    result's sign (negative: sums pulled toward zero, as truncation does), for a few
    [m x k] @ [k x n] shapes (cuBLAS picks its kernel by shape). float64 on the GPU is
    the exact reference."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m, k, n in ((256, 256, 256), (256, 4096, 256), (256, 16384, 256),
                    (1024, 1024, 1024), (1024, 4096, 1024), (4096, 4096, 4096)):
        a = round_to_tf32(torch.randn(m, k, generator=g)).cuda()
        b = round_to_tf32(torch.randn(k, n, generator=g)).cuda()
        exact = a.double() @ b.double()
        scale = a.double().abs() @ b.double().abs()
        for on in (False, True):
            tf32(on)
            err = ((a @ b).double() - exact) / scale
            name = f"[{m}x{k}]@[{k}x{n}] {'tensor cores (tf32 on)' if on else 'float32 (tf32 off)'}"
            out[f"{name}: mean |err|"] = float(err.abs().mean())
            out[f"{name}: mean signed err toward |y|"] = float((err * exact.sign()).mean())
    tf32(False)
    return out


def split(x: torch.Tensor):
    hi = round_to_tf32(x)
    return hi, round_to_tf32(x - hi)


def matmul_3xtf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (ah, al), (bh, bl) = split(a), split(b)
    tf32(True)
    y = (al @ bh + ah @ bl) + ah @ bh
    tf32(False)
    return y


def matmul_errors(n: int = 1024, k: int = 4096, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, k, generator=g), torch.randn(k, n, generator=g)
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    ac, bc = a.cuda(), b.cuda()
    ys = {}
    tf32(False)
    ys["float32"] = ac @ bc
    tf32(True)
    ys["tf32 (real)"] = ac @ bc
    tf32(False)
    ys["tf32 emulated, ties to even"] = round_to_tf32(ac) @ round_to_tf32(bc)
    ys["tf32 emulated, ties away"] = rna(ac) @ rna(bc)
    ys["3xtf32 (real tf32 matmuls)"] = matmul_3xtf32(ac, bc)
    out = {name: float(((y.cpu().double() - exact).abs() / scale).mean()) for name, y in ys.items()}
    real = ys["tf32 (real)"].cpu().double()
    for name in ("tf32 emulated, ties to even", "tf32 emulated, ties away"):
        out[f"real vs {name}"] = float(((real - ys[name].cpu().double()).abs() / scale).mean())
    return out


def speed(n: int = 8192) -> dict:
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    splits = (split(a), split(b))

    def f32():
        tf32(False)
        return a @ b

    def t32():
        tf32(True)
        return a @ b

    def x3():
        (ah, al), (bh, bl) = splits  # operands split once (weights would be split once)
        tf32(True)
        return (al @ bh + ah @ bl) + ah @ bh

    out = {}
    for name, fn in (("float32", f32), ("tf32", t32), ("3xtf32 (operands pre-split)", x3)):
        times = []
        for i in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        out[name] = round(2 * n**3 / times[len(times) // 2] / 1e12, 1)
    tf32(False)
    return out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this script needs a CUDA device")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "issue_53635": issue_53635(),
           "rounding": {**rounding_fingerprint(),
                        **rounding_fingerprint(rows=64, n=64, seed=1, tag="[64x64] "),
                        **rounding_fingerprint(rows=4096, n=4096, seed=2, tag="[4096x4096] ")},
           "subnormals": subnormals(), "accumulation": accumulation(),
           "matmul_error": matmul_errors(), "tflops": speed()}
    print(f"GPU: {res['gpu']}, torch {res['torch']}, CUDA {res['cuda']}")
    for section in ("issue_53635", "rounding", "subnormals", "accumulation", "matmul_error",
                    "tflops"):
        print(f"\n{section}:")
        for k, v in res[section].items():
            print(f"  {k:55s} {v:.6g}" if isinstance(v, float) else f"  {k:55s} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
