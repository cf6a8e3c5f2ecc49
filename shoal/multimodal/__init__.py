"""Images in: media loading (media.py), the processors that expand a prompt's placeholders
(processors/), the per-item data that crosses to the engine (inputs.py) and the encoder
cache the scheduler keeps the books of (encoder_cache.py)."""
