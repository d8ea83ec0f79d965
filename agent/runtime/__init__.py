"""Thin asyncio shells that pump bytes and apply what the cores decide."""
