"""GPU kernels of quantized linear layers (FP8 and INT4 weights kept packed on CUDA) and the
objects that run them (methods.py); shoal/quantization decides at load which layer gets one."""
