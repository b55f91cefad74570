"""Generated gRPC stubs: do not edit."""
