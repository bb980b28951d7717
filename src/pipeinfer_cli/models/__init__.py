"""Model files: the registry, fetching and the cache, GGUF metadata, identities, layer splits
and the weight slices a rank receives."""
