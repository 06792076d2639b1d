"""Conversation sessions at the gateway: the turns of a request's session (turns.py) and /v1/sessions (routes.py)."""
