"""An OpenAI-compatible HTTP server for one model (``cpullm serve``), built on starlette + uvicorn."""
from .http import create_app, is_loopback, serve

__all__ = ["create_app", "is_loopback", "serve"]
