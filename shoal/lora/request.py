"""vLLM's import path of LoRARequest (`from vllm.lora.request import LoRARequest`). The class
lives in shoal/lora_request.py, below shoal.core, which carries it in requests."""

from shoal.lora_request import LoRARequest

__all__ = ["LoRARequest"]
