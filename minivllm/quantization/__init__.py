"""Quantization: KV-cache storage formats now; weight quantization comes later."""
