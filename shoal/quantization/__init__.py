"""Quantized safetensors checkpoints (FP8, GPTQ, AWQ, compressed-tensors), dequantized to
dense weights as they stream from disk, so every model loads every format unchanged
(weights.py). config.py is torch-free: engine arguments check names against it."""
