"""`streamrec serve`: a serving node."""

from __future__ import annotations

import argparse
import dataclasses

from streamrec.cli.common import Commands
from streamrec.plumbing.config import Config, ConfigError


def add_parser(commands: Commands) -> None:
    sv = commands.defaults["serving"]
    serve = commands.add("serve", "serve predictions over HTTP; follows new model versions, hot-swaps them, rolls back on request", run)
    serve.add_argument("--host", help=f"listen address (serving.host: {sv['host']})")
    serve.add_argument("--port", type=int, help=f"listen port (serving.port: {sv['port']})")
    serve.add_argument("--model", help="the one model to serve (model.name); with [[serving.models]], one of them")
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
    from streamrec.serving.http.server import serve

    serve(only_model(cfg, args.model) if args.model else cfg)
    return 0


def only_model(cfg: Config, name: str) -> Config:
    """``cfg`` serving model ``name`` alone: ``--model`` picks one of [[serving.models]] (with
    its own model_store, if any) rather than being overruled by the list. ConfigError when
    ``name`` is not listed, or a configured experiment needs another model."""
    s = cfg.serving
    if not s.models:
        return cfg  # the flag set model.name, which a node without [[serving.models]] serves
    chosen = tuple(m for m in s.models if m.name == name)
    if not chosen:
        raise ConfigError(f"--model {name}: not among serving.models {[m.name for m in s.models]}; list it there, "
                          "or leave --model out to serve them all")
    others = {e.name: sorted(({v.model for v in e.variants} | {e.shadow_model}) - {name, ""}) for e in s.experiments}
    needing = {experiment: models for experiment, models in others.items() if models}
    if needing:
        raise ConfigError(f"--model {name}: serving.experiments {needing} need other models, which this node would not serve; "
                          "give it a configuration without them, or leave --model out")
    return dataclasses.replace(cfg, serving=dataclasses.replace(s, models=chosen))
