"""Operating the gateway: /health and /ready, /metrics and the requests' introspection, and the dashboard
(its page, script and style in static/)."""
