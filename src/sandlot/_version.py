"""The one place the version is written (``sandlot.__version__`` re-exports it)."""

__version__ = "0.1.0"
