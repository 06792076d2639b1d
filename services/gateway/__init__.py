"""The gateway: HTTP + Server-Sent Events in front of the bus."""
