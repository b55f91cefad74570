"""gRPC service layer: thin handlers that decode, call the core, encode."""
