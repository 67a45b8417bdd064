"""The client side: one shard's channel (ShardClient) with its payloads' transport (Transport: frames or shared
memory, picked at Join), and a worker's view of the whole job (ParameterClient)."""
