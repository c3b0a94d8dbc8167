"""The gRPC front: the servicer, GenerateMany multiplexing and Prometheus metrics, over the engine-core client."""
