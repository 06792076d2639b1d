"""A `conveyor up` cluster under load or faults: soak, chaos, CPU contention, a first token hop by hop, tracing and
the dashboard's cost, routing, the janitor's cap."""
