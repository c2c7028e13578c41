"""Shared fixtures: a tiny random Llama folder, and the embedded model (integration)."""

from __future__ import annotations

import kernels  # noqa: F401  (before torch/transformers import Triton: interpreter on CPU)
import pytest
import torch

from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread avoids oversubscribing a shared 2-core box
    (restored after the module)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path to a tiny random Llama HF folder (2 layers, hidden 64, GQA 4/2 heads)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    """transformers' LlamaForCausalLM on the same tiny weights, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def embedded_model_dir():
    """The converted SmolLM2-135M-Instruct folder (fetched and converted on first use)."""
    from minivllm.models.embedded import ensure_embedded_model

    return ensure_embedded_model()
