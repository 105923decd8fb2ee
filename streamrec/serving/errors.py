"""The one exception an HTTP route raises to answer with a JSON error, and the errors that
both the serving process (serving/http/app.py) and a front-end process (serving/http/frontend.py) raise."""

from __future__ import annotations

import orjson


class ApiError(Exception):
    """``{"error": {"code": status, "message": message}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> bytes:
        return orjson.dumps({"error": {"code": self.status, "message": self.message}})

    def headers(self) -> list[tuple[bytes, bytes]]:
        """JSON; a 429 (queue full) or 503 (deadline passed, no version yet, model store unreachable)
        also says when to retry."""
        if self.status in (429, 503):
            return [(b"content-type", b"application/json"), (b"retry-after", b"1")]
        return [(b"content-type", b"application/json")]


class SpecChanged(ApiError):
    """A 503 after which a front-end must ask the serving process again for the served feature spec
    (none loaded yet, or it changed while the request waited)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


def unknown_model(asked: str, served: str | None) -> ApiError:
    return ApiError(404, f"unknown model {asked!r}; this server serves {served!r}")


def no_feature_store() -> ApiError:
    return ApiError(400, "this node has no online feature store (serving.feature_store = false): "
                         'send {"instances": [...]} with every feature')


# how the 400 for a by-ids ``ts`` older than the online features keep goes on (clients may tell it apart)
BEYOND_HORIZON = "features are kept for requests at most"
NOT_LOADED = "no model version is loaded yet"  # how a 503 of a model without a version begins (clients may tell it apart)


def not_loaded() -> ApiError:
    return SpecChanged(f"{NOT_LOADED}; try again shortly (GET /readyz)")


def one_authorization(raw_headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a request with several ``Authorization`` headers: which one counts would depend
    on the path it takes (the serving process reads the first, a relay would keep one), so neither does."""
    if sum(1 for name, _ in raw_headers if name.lower() == b"authorization") > 1:
        raise ApiError(400, "more than one Authorization header: send exactly one")


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, or None when it holds none.
    The scheme is matched case-insensitively (RFC 9110, 11.1): clients send ``bearer`` too."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip(" ")
    return token if scheme.lower() == "bearer" and token else None
