"""Frontends that turn a user's requests into engine requests: the offline LLM (the server is the online one)."""
