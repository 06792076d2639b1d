"""The worker: an engine (paged KV cache, continuous batching) behind a Redis stream."""
