"""The HTTP face of the store: FastAPI routes over the engine, and the web pages."""

from service.api.app import create_app

__all__ = ["create_app"]
