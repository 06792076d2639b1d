"""The OpenAI Responses API (/v1/responses): its body as a chat body, its output items, events and stored responses."""
