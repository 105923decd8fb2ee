"""`streamrec serve`: a serving node."""

from __future__ import annotations

import argparse

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config


def add_parser(commands: Commands) -> None:
    sv = commands.defaults["serving"]
    serve = commands.add("serve", "serve predictions over HTTP; follows new model versions, hot-swaps them, rolls back on request", run)
    serve.add_argument("--host", help=f"listen address (serving.host: {sv['host']})")
    serve.add_argument("--port", type=int, help=f"listen port (serving.port: {sv['port']})")
    serve.add_argument("--model", help="model name (model.name)")
    serve.add_argument("--model-store", dest="serving_model_store", help=f"model store root or URI (serving.model_store: {sv['model_store']})")
    serve.add_argument("--device", dest="serving_device", help=f"auto | cpu | cuda[:N] (serving.device: {sv['device']})")
    serve.add_argument("--admin-token", help="bearer token of the admin routes (serving.admin_token; prefer the env variable)")
    serve.add_argument("--poll-interval", type=float, help=f"seconds between LATEST checks (serving.poll_interval_s: {sv['poll_interval_s']})")
    serve.add_argument("--compile", dest="serving_compile", choices=["auto", "eager", "compile", "graph", "compile+graph"],
                       help=f"how the model runs: shape buckets as CUDA graphs and/or torch.compile (serving.compile: {sv['compile']})")
    serve.add_argument("--workers", dest="serving_workers",
                       help=f"batches in flight at once, each on its own CUDA stream; 0 = on the event loop's thread; auto = 0 "
                            f"on CUDA, 1 on CPU (serving.workers: {sv['workers']})")
    serve.add_argument("--frontends", type=int, dest="serving_frontends",
                       help=f"HTTP front-end processes feeding this one (serving.frontends: {sv['frontends']}; 0 = none)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.serving.server import serve

    serve(cfg)
    return 0
