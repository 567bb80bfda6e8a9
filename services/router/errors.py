"""OpenAI-style API errors: one exception type that knows its HTTP status and error body.

Body shape (what the ``openai`` SDK parses)::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Pure: no HTTP framework imports.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request that ends in an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "api_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def rate_limited(message: str, retry_after_s: int) -> ApiError:
    """429 with a ``Retry-After`` header in whole seconds (at least 1)."""
    retry_after_s = max(1, int(retry_after_s))
    return ApiError(
        429,
        message,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )
