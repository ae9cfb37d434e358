"""ckptstore's torch-free engine: format, metadata database, blob stores and the store itself."""

__version__ = "0.1.0"
