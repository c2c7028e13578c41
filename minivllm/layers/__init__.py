"""minivllm.layers."""
