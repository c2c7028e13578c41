"""Triton kernels, each beside its PyTorch reference (Triton attention comes in a later issue)."""
