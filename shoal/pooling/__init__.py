"""Pooling: what a pooling model offers (model_info), how hidden states become embeddings,
class probabilities and scores (pooler)."""
