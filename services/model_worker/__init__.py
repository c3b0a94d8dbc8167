"""The model worker: a thin gRPC front (server/) over an engine-core process that steps Qwen3 on the GPU or CPU."""
