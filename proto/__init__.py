"""gRPC API definitions (``inference.proto``) and generated stubs; the gRPC sidecar that serves
them is its own issue. ``--grpc-port`` is accepted and validated already (``0`` disables)."""
