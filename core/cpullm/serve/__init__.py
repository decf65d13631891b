"""An OpenAI-compatible HTTP server for one model (``cpullm serve``), built on starlette + uvicorn.

- ``engine.py``: the model's generations on its scheduler, one cancellable job per request;
- ``openai.py``: the OpenAI API: request checks and parsing, response objects, OpenAI-shaped errors;
- ``http.py``: the ASGI application (routes, Host and API-key guard, server-sent events), the
  chat page in ``static/``, and running it with uvicorn.

Lower to higher: ``openai`` <- ``engine`` <- ``http``. Importing this package needs neither
starlette nor uvicorn; creating or running the application does.
"""
from .engine import Engine, Job
from .http import create_app, is_loopback, serve
from .openai import Api, ApiError, RequestSpec, error_body

__all__ = ["Api", "ApiError", "Engine", "Job", "RequestSpec", "create_app", "error_body", "is_loopback",
           "serve"]
