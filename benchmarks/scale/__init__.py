"""The control plane at scale: thousands of concurrent streams on simulated workers, a Redis Cluster against one
redis-server, a Redis round trip by transport."""
