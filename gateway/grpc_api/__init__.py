"""The public gRPC front: GatewayService, a thin adapter from its protos to the generation core."""
