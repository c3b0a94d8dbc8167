"""LoRA adapters: PEFT folders read and checked, their weights in per-layer slots, applied per row group."""
