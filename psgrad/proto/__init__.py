"""Generated protobuf/gRPC code for protos/psgrad/proto/ps.proto (regenerate with protos/generate.py)."""
