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
    405: "invalid_request_error",
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


def http_error(status: int, method: str, path: str, allow: str = "") -> ApiError:
    """The error for a request no route takes: unknown URL (404), wrong method (405), other."""
    shown = path if len(path) <= 200 else path[:200] + "..."
    if status == 404:
        return ApiError(404, f"Invalid URL ({method} {shown})", code="unknown_url")
    if status == 405:
        allowed = f"; use {allow}" if allow else ""
        return ApiError(405, f"Method {method} is not allowed on {shown}{allowed}",
                        code="method_not_allowed", headers={"Allow": allow} if allow else None)
    return ApiError(status, f"{method} {shown} failed with HTTP status {status}")


def invalid_fields(errors: list[dict[str, Any]]) -> ApiError:
    """A 400 for a framework validation failure (a list of {"loc": [...], "msg": ...})."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return bad_request(f"{param}: {message}" if param else str(message), param=param)


def rate_limited(message: str, retry_after_s: int) -> ApiError:
    """429 with a ``Retry-After`` header in whole seconds (at least 1)."""
    retry_after_s = max(1, int(retry_after_s))
    return ApiError(
        429,
        message,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )
