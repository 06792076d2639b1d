"""A request's life in the gateway, whatever API it came by: intake, its handle, driving it to its end, its one
outcome, stop strings, the link to the bus (core), its metrics and spans, and the cluster repairs."""
