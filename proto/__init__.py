"""Generated gRPC stubs of proto/inference.proto (see its header for the command)."""
