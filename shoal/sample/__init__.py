"""From logits to tokens: the sampler and its per-step metadata, and the verification of
speculative drafts (the rejection sampler), below both the model runner and the drafters."""
