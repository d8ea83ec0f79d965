"""Composition and the user's surface: the service, configuration, commands."""
