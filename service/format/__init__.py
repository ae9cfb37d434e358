"""Format v1: tensor digests, shard headers, shard planning and the manifest."""
