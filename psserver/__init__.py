"""A parameter-server shard: holds a slice of a model's variables and their optimizer state."""
