"""The native API: POST /generate (JSON, or Server-Sent Events)."""
