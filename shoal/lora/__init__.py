"""LoRA adapters: many fine-tunes served over one base model (PEFT folders, batched per step)."""
