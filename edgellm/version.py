"""The package version (one place; `edgellm.__version__` re-exports it)."""

__version__ = "0.1.0"
