"""The HTTP API of a serving node (docs/serving.md), on FastAPI: routes only; the work is the
model runtimes' (serving/runtime/model_runtime.py).

Routes (serving/http/routes/): ``POST /v1/models/{model}:predict``, ``POST
/v1/experiments/{name}:predict``, ``GET /v1/models``, ``GET /v1/models/{model}``,
``POST /v1/models/{model}:reload`` and ``:rollback`` (admin: bearer token), the experiments'
admin routes,
``GET /healthz``, ``GET /readyz``, ``GET /metrics``. Every error is JSON
``{"error": {"code": <http status>, "message": "..."}}`` with a message that says what is
wrong; no input can take the server down. The OpenAPI schema is at ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from streamrec import __version__
from streamrec.serving.node import ServingNode
from streamrec.serving.http.frontend import FrontendPlan, FrontendPool
from streamrec.serving.runtime.ipc import FrontendLink
from streamrec.serving.http.routes.errors import install_error_handlers
from streamrec.serving.http.routes.experiments import add_experiment_routes
from streamrec.serving.http.routes.health import add_health_routes
from streamrec.serving.http.routes.models import add_model_routes
from streamrec.serving.http.routes.predict import add_predict_routes


def create_app(node: ServingNode, frontends: FrontendPlan | None = None) -> FastAPI:
    """The node's API; with ``frontends`` it also starts those processes and answers the
    predict requests they send over the Unix socket (serving/http/frontend.py)."""
    link = FrontendLink(frontends.socket_path, node.hello, node.take) if frontends else None
    if link is not None:
        node.welcome_listeners.append(link.broadcast)
    # redirect_slashes off: a path with a trailing slash is a 404, never a redirect built from
    # the Host header, which behind a front-end names the serving process's private loopback port
    app = FastAPI(title="streamrec serving", version=__version__, lifespan=_lifespan(node, link, frontends),
                  description="Online CTR predictions from continuously updated models.", redirect_slashes=False)
    app.state.node = node
    install_error_handlers(app)
    add_predict_routes(app, node)
    add_model_routes(app, node)
    add_experiment_routes(app, node)
    add_health_routes(app, node, link, frontends.count if frontends else 0)
    return app


def _lifespan(node: ServingNode, link: FrontendLink | None, frontends: FrontendPlan | None):
    """Starts the node (and the front-end link and processes) before the first request; at
    shutdown the front-ends drain their in-flight requests through the node first."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await node.start()
        pool = None
        if link is not None:
            await link.start()
            pool = FrontendPool(frontends).start()
        yield
        if pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, pool.stop)
            await link.stop()
        await node.stop()

    return lifespan
