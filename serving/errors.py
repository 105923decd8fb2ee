"""The one exception an HTTP route raises to answer with a JSON error (serving/app.py)."""


class ApiError(Exception):
    """``{"error": {"code": status, "message": message}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
