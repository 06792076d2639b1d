"""The cluster scheduler: admission queue by (priority, arrival), worker choice, cancel routing."""
