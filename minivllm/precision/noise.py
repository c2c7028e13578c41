"""Noise floor: how much does a configuration differ from *itself* when only the order of
a floating-point reduction changes?

Permuting the MLP's intermediate units (rows of ``gate_up_proj`` for gate and up alike,
and the matching columns of ``down_proj``) leaves the function mathematically unchanged:
``down(silu(gate(x)) * up(x))`` is a sum over the intermediate units, and addition is
commutative. In floating point it is not associative, so the permuted model sums in a
different order and its outputs move by rounding alone. The drift metrics between the
model and its permuted copy are the floor below which a difference is indistinguishable
from normal floating-point variation (the same variation a different GEMM kernel, batch
size or thread count causes).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def permuted_mlp_reduction(llm, seed: int = 0):
    """Within the block, every layer's MLP sums its intermediate units in a random order.

    Args:
        llm: an ``LLM`` (its model's weights are permuted in place and restored after).
        seed: chooses the permutations.
    """
    model = llm.llm_engine.model_runner.model
    gen = torch.Generator().manual_seed(seed)
    saved: list[tuple[torch.Tensor, ...]] = []
    with torch.no_grad():
        for layer in model.layers:
            mlp = layer.mlp
            inter = mlp.intermediate
            perm = torch.randperm(inter, generator=gen).to(mlp.down_proj.weight.device)
            gu, down = mlp.gate_up_proj.weight, mlp.down_proj.weight
            saved.append((gu.detach().clone(), down.detach().clone()))
            gu.copy_(torch.cat([gu[:inter][perm], gu[inter:][perm]]))
            down.copy_(down[:, perm])
            if mlp.gate_up_proj.bias is not None:
                b = mlp.gate_up_proj.bias
                saved[-1] += (b.detach().clone(),)
                b.copy_(torch.cat([b[:inter][perm], b[inter:][perm]]))
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, s in zip(model.layers, saved):
                layer.mlp.gate_up_proj.weight.copy_(s[0])
                layer.mlp.down_proj.weight.copy_(s[1])
                if len(s) > 2:
                    layer.mlp.gate_up_proj.bias.copy_(s[2])
