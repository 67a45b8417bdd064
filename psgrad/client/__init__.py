"""The client side: one shard's channel (ShardClient) and a worker's view of the whole job (ParameterClient)."""
