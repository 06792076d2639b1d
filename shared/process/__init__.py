"""What every service process does the same way: its runtime (logging, instance id, stop signals), what a bus
service builds (service), the services' table (service_table), liveness and the container's health file, waiting
for /ready, tracing (telemetry) and the one backoff."""
