"""The pure core: shard plan, job layout, consistency policies, server optimizers and wire codecs (no gRPC, no threads)."""
