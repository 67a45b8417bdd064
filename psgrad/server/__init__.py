"""The server side: a shard's state and its transfers, the gRPC servicer, and the process runtime."""
