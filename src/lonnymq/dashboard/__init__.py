"""A web dashboard for a queue: ``lonnymq dashboard``, or ``app(queue)`` mounted in your own
ASGI application. Needs the ``dashboard`` extra (``pip install 'lonnymq[dashboard]'``)."""

from ._app import app

__all__ = ["app"]
