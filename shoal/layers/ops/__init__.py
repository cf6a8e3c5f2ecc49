"""Triton kernels of the layers around attention (RMSNorm, SiLU-and-mul, rotary) and the
switch that picks them over the PyTorch path. Each module holds one kernel and a wrapper that
checks shapes, strides and dtypes before launching; import the wrappers from their modules."""
