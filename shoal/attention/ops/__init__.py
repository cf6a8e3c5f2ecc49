"""Triton kernels for the GPU fast path: attention over the paged KV cache and the fused
elementwise layers around it. Each module holds one kernel and a wrapper that checks shapes,
strides and dtypes before launching; import the wrappers from their modules (the function
names match the module names, so they are not re-exported here)."""
