"""An error's body in the shape of the API its path belongs to, so that each API's clients show
the message: OpenAI's under /v1/, Anthropic's under /v1/messages, ours elsewhere.
`error_type` is ours (validation, http, internal, ...)."""

from __future__ import annotations

# HTTP status -> Anthropic's error type
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def openai_error(message: str, error_type: str, status_code: int) -> dict:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}


def anthropic_error(message: str, status_code: int) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status_code, "api_error"), "message": message}}


def error_body(path: str, message: str, error_type: str, status_code: int) -> dict:
    if is_anthropic(path):
        return anthropic_error(message, status_code)
    if path.startswith("/v1/"):  # OpenAI's clients show only error.message
        return openai_error(message, error_type, status_code)
    return {"error": message, "error_type": error_type}
