"""Triton kernels for attention over the paged KV cache (decode, prefill, KV write, and the
q/k-norm + rotary + KV write). Each module holds one kernel and a wrapper that checks shapes,
strides and dtypes before launching; import the wrappers from their modules (the function
names match the module names, so they are not re-exported here). The kernels of the layers
around attention live in shoal/layers/ops. cpu_paged_decode.py calls the CPU's decode kernel, in
C++ (shoal/csrc, built ahead of time as a torch extension by shoal/cpu_kernels.py)."""
