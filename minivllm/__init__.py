"""minivllm: a compact, readable vLLM-style inference engine for the precision course."""

import minivllm_kernels as _kernels  # noqa: F401  (first: on CPU-only machines it sets TRITON_INTERPRET=1)

from minivllm.engine.arg_utils import EngineArgs
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "Logprob"]
