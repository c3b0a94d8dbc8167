"""What the worker is told: the engine's settings, the checkpoint's model config, and each request's sampling parameters."""
