"""tiergram: serve Engram n-gram memory tables from a memory hierarchy at close to resident speed."""

__version__ = "0.1.0"
