"""Redis itself: the clients every service makes (redis_client), their Redis Cluster subclasses that ride out a
failover (redis_cluster_client, redis_cluster_aio), the single Redis's clients whose pipelines check a script
once a connection (scripts), a local redis-server (redis_server), and its replies as Python
values (replies)."""
