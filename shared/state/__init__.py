"""A request's and a session's state in Redis: the context store's layers (context_store), the lifecycle's one
transitions table and its Lua compare-and-set (lifecycle), the change feed (lifecycle_feed), conversation sessions
(sessions), the janitor that keeps the indexes in step with expiring keys (janitor), and noticing a Redis that lost
its data (epoch)."""
