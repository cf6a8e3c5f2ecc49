"""Vision encoders of the vision-language models: plain torch modules, no KV cache."""
