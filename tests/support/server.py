"""A real Jupyter Server with the extension enabled, and a caller for its endpoints.

Test modules use it with ``from .server_support import *``, which also brings
pytest-jupyter's server fixtures into those modules only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403
from tornado.httpclient import HTTPClientError, HTTPResponse

Api = Callable[..., Any]


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"notebook_launcher.server": True}}}


@pytest.fixture
def api(jp_fetch: Any, jp_asyncio_loop: Any) -> Api:
    """Call an endpoint under /notebook-launcher/ (or another path) and return (status, body).

    The body is the parsed JSON, or the text of one of Jupyter's own HTML error pages.
    """

    def call(
        *parts: str,
        method: str = "GET",
        body: object = None,
        prefix: str = "notebook-launcher",
        **kwargs: Any,
    ) -> tuple[int, Any]:
        if body is not None:
            kwargs["body"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        try:
            response: HTTPResponse = jp_asyncio_loop.run_until_complete(
                jp_fetch(prefix, *parts, method=method, **kwargs)
            )
        except HTTPClientError as e:
            assert e.response is not None
            response = e.response
        if not response.body:
            return response.code, None
        try:
            return response.code, json.loads(response.body)
        except ValueError:
            return response.code, response.body.decode(errors="replace")

    return call
