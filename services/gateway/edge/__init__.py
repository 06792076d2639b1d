"""What every HTTP request crosses before a route runs, and the HTTP around the routes: ASGI middleware, API keys,
the error shape, log redaction, the OpenAPI document, SSE responses, the core dependency, and the server."""
