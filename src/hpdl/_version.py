"""hpdl's version, in a leaf module: the root package and the lower floors (`runtime`) read it from here."""

__version__ = "0.1.0"
