"""The Qwen3 model, its checkpoint loader, and the fused CPU decode loop."""
