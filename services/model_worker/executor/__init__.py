"""One step on a device: the model runner, step inputs and transfers, CUDA graphs, the KV cache and its sizing, the sampler."""
