"""The KV cache: the paged pool (kv_cache), its blocks and prefix cache (block_manager), and the KV of paused
conversation sessions (session_kv) with its second tier on disk (kv_tier)."""
