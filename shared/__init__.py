"""Code every Conveyor service imports: events, bus, context store, lifecycle, settings, telemetry."""
