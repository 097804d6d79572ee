"""OpenAI-style errors: every failure leaves as {"error": {message, type, param, code}}."""

from __future__ import annotations

import json
import traceback
from typing import Any

from starlette.responses import Response

from admission.errors import AdmissionError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        error = {
            "message": self.message,
            "type": _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error"),
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}

    def response(self) -> Response:
        return Response(
            json.dumps(self.body()), status_code=self.status, media_type="application/json", headers=self.headers
        )


_ADMISSION_STATUS = {"invalid": 400, "forbidden": 403, "over_rate": 429, "shed": 503}


def from_admission(err: AdmissionError) -> APIError:
    """Admission's refusal as HTTP: 400, 403, 429 or 503, with Retry-After where it says when."""
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return APIError(_ADMISSION_STATUS[err.kind], err.message, param=err.param, code=err.code, headers=headers, extra=err.details)


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def describe(exc: BaseException, with_message: bool = False) -> str:
    """An exception for the logs without what it may quote: messages can carry a prompt, an
    answer or a header (a validation error echoes its input), so by default only the type and
    where it was raised; the message only where prompt logging is enabled."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    text = f"{type(exc).__name__}{where}"
    return f"{text}: {exc}" if with_message else text
