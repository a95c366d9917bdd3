"""The error a client's request causes, raised wherever a request is prepared."""

from __future__ import annotations


class RequestError(Exception):
    """An error the client caused: answered with `status_code` and this message."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code
