"""The engine-core process, the client that talks to it from the gRPC front, the socket protocol between them, and the KV-event feed the client keeps."""
