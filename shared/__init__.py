"""Code every Conveyor service imports, by concern: wire/ (events, key names, the bus), state/ (the context store,
the lifecycle and sessions tables, the janitor), redis_io/ (the clients), process/ (the service runtime, liveness,
tracing), text/ (tokenizer, chat template, grammars, model files), settings/. It never imports services/."""
