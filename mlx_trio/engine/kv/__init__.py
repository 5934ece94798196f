"""KV caches of a batch: per-layer join/leave surgery, the host-padded batch cache, copies, byte layout."""
