"""OpenAI-compatible HTTP server (``minivllm serve``): api_server, protocol, metrics."""
