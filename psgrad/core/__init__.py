"""The pure core: shard plan, job layout, consistency policies, server optimizers and their settings, wire codecs and server addresses (no gRPC, no threads)."""
