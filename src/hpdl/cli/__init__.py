"""Command line: `hpdl launch | info | bench`."""

__all__: list[str] = []
