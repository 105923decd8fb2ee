"""``GET /v1/experiments`` and the admin calls ``PUT`` and ``DELETE /v1/experiments/{name}``
(``Authorization: Bearer <serving.admin_token>``): experiments changed at run time are
recorded in the model store, so every node serves them, a restarted one too (docs/experiments.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import FastAPI, Request

from streamrec.serving.errors import ApiError
from streamrec.serving.access.experiments import entry_from_json, entry_to_json
from streamrec.serving.node import ServingNode
from streamrec.serving.http.routes.models import check_admin
from streamrec.serving.http.shortcut import read_body


def add_experiment_routes(app: FastAPI, node: ServingNode) -> None:
    settings = node.settings

    def experiments():
        if node.experiments is None:
            raise ApiError(404, "this node runs no experiments (serving.experiments)")
        return node.experiments

    @app.get("/v1/experiments")
    async def list_experiments() -> dict[str, Any]:
        """Every experiment in force: its variants, shares, layer and range, shadow, and source
        (config or store); configured ones deleted at run time; store records not applied here."""
        return experiments().as_json()

    @app.get("/v1/experiments/{name}")
    async def get_experiment(name: str) -> dict[str, Any]:
        try:
            return entry_to_json(experiments().get(name))
        except KeyError:
            raise ApiError(404, f"unknown experiment {name!r}; this node runs {experiments().names()}") from None

    @app.put("/v1/experiments/{name}")
    async def put_experiment(name: str, request: Request) -> dict[str, Any]:
        """Add or replace an experiment on every node: ``{"variants": [{"name", "model",
        "share"}, ...], "salt"?, "layer"?, "range_start"?, "range_end"?, "shadow_model"?, "shadow_share"?}``."""
        book = experiments()
        check_admin(request, settings.admin_token)
        body = await read_body(request.scope, request.receive, settings.max_body_bytes)
        try:
            entry = entry_from_json(orjson.loads(body), name=name)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        except ValueError as exc:
            raise ApiError(400, f"invalid experiment: {exc}") from None
        await _change(book.put, entry)
        node.experiments_changed()
        return entry_to_json(book.get(name))

    @app.delete("/v1/experiments/{name}")
    async def delete_experiment(name: str, request: Request) -> dict[str, Any]:
        """Stop the experiment on every node (its requests then get 404)."""
        book = experiments()
        check_admin(request, settings.admin_token)
        try:
            await _change(book.delete, name)
        except KeyError:
            raise ApiError(404, f"unknown experiment {name!r}; this node runs {book.names()}") from None
        node.experiments_changed()
        return {"deleted": name, "experiments": book.names()}


async def _change(fn, arg) -> None:
    """A store write off the event loop: 400 for a rejected experiment, 503 for an unreachable store."""
    try:
        await asyncio.get_running_loop().run_in_executor(None, fn, arg)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    except OSError as exc:
        raise ApiError(503, f"the model store cannot be reached: {exc}; the experiment is unchanged") from None
