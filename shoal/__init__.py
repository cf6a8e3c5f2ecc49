"""shoal: a paged-KV LLM inference and serving engine."""

from shoal.llm import LLM
from shoal.outputs import CompletionOutput, RequestOutput
from shoal.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
