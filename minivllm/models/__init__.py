"""minivllm.models."""
