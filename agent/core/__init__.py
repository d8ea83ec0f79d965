"""Pure parts: no asyncio, socket, sqlite3 or threads (see docs/architecture.md)."""
