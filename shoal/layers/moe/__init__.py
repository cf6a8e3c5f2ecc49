"""Mixture-of-experts layers: a softmax top-k router (router.py) and the routed expert MLPs
(layer.py), computed by a grouped-GEMM Triton kernel on CUDA (triton_experts.py, fed by the
graph-safe token grouping in align.py) and by plain PyTorch elsewhere (torch_experts.py)."""
