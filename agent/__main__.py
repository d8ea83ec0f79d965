"""`python -m agent` is the same as the `hl7-agent` console script."""

from __future__ import annotations

from agent.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
