"""Serving cartridges: the store (files, routing) and the OpenAI-compatible server."""
