"""The queue database: the only code that runs SQL."""
