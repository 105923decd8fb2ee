"""`streamrec store ls | verify | pin | unpin`: the operator's view of a model store."""

from __future__ import annotations

import argparse
import json
import time

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config


def add_parser(commands: Commands) -> None:
    t = commands.defaults["trainer"]
    store = commands.add("store", "the operator's view of a model store: list and verify versions, pin or unpin one", run,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="The store is --model-store, else trainer.model_store; the model is --model, else model.name.\n"
                                "A pin holds every serving node on one version (as :rollback does) until `store unpin`.")
    actions = store.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    for action, text in (("ls", "list the versions, LATEST, the pin and the writer lease"),
                         ("verify", "check every version's files (size, sha256, Arrow, finite values) and chain; "
                                    "exit 1 on any problem"),
                         ("pin", "hold every serving node on VERSION until `store unpin` (or :reload)"),
                         ("unpin", "release the pin (or remove a PIN file that does not parse): serving nodes follow LATEST again")):
        p = add_action(actions, action, text)
        p.add_argument("--model", help="model name (model.name)")
        p.add_argument("--model-store", help=f"model store root or URI (trainer.model_store: {t['model_store']})")
        if action in ("ls", "verify"):
            p.add_argument("--json", action="store_true", help="print JSON")
        if action == "verify":
            p.add_argument("--version", type=int, nargs="+", action="extend", metavar="N",
                           help="check only these versions (and the chains they need): --version 3 5, or repeated")
        if action == "pin":
            p.add_argument("version", type=int, help="the version to serve")
            p.add_argument("--reason", default="", help="why (recorded with the pin)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    import getpass
    import socket

    from streamrec.modelstore.report import describe
    from streamrec.modelstore.store import ModelStore

    store = ModelStore(cfg.trainer.model_store, cfg.model.name)
    if args.store_command == "ls":
        report = describe(store)
        print(json.dumps(report, indent=2) if args.json else _store_table(report))
        return 0
    if args.store_command == "verify":
        return _verify(args, store)
    if args.store_command == "pin":
        pin = store.pin(args.version, f"{getpass.getuser()}@{socket.gethostname()} (streamrec store pin)", args.reason)
        print(f"pinned version {pin.version} of {store.model}: every serving node serves it within its poll interval")
        return 0
    return _unpin(store)


def _unpin(store) -> int:
    """Release the pin; a PIN file that does not parse is removed too (what its error says to do)."""
    from streamrec.modelstore.store import CorruptVersion

    try:
        held = store.pinned()
    except CorruptVersion:
        store.unpin()
        print(f"removed {store.base}/PIN, which was not a valid pin: serving nodes follow LATEST again")
        return 0
    store.unpin()
    print(f"released the pin to version {held.version}" if held else f"{store.model} had no pin")
    return 0


def _verify(args: argparse.Namespace, store) -> int:
    """Exit 1 on any problem."""
    from streamrec.modelstore.report import verify

    report = verify(store, args.version)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for where, problems in report["problems"].items():
            for problem in problems:
                print(f"{where}: {problem}")
        verdict = "all sound" if report["ok"] else f"{len(report['problems'])} with problems"
        print(f"{report['root']}: {len(report['checked'])} version(s) checked ({_ranges(report['checked']) or 'none'}), {verdict}")
        if report["deleted_during_check"]:
            print(f"deleted while being checked (retention or compaction), not problems: {_ranges(report['deleted_during_check'])}")
    return 0 if report["ok"] else 1


def _ranges(versions: list[int]) -> str:
    """Ascending versions as runs: 1-4, 7, 9-12."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][-1] + 1:
            runs[-1][-1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _store_table(report: dict) -> str:
    lines = [f"{report['model']} at {report['root']}"]
    if report["latest_problem"]:
        lines.append(f"  LATEST: {report['latest_problem']}")
    pin = report["pin"]
    if pin:
        lines.append(f"  pinned to {pin['version']} by {pin['by']} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(pin['at']))}"
                     + (f": {pin['reason']}" if pin["reason"] else ""))
    elif report["pin_problem"]:
        lines.append(f"  PIN: {report['pin_problem']}")
    lease = report["lease"]
    if lease:
        lines.append(f"  writer: pid {lease['pid']} on {lease['host']} ({lease['work_dir']}), lease token {lease['token']}, "
                     + ("live" if lease["live"] else "released" if lease["released"] else "expired"))
    lines.append(f"  {'VERSION':>8} {'KIND':5} {'PARENT':>8} {'CREATED':19} {'ROWS':>11} {'BYTES':>13}  MARK")
    for v in report["versions"]:
        if "problem" in v:
            lines.append(f"  {v['version']:>8} {v['problem']}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"])) if v["created_at"] else "?"
        mark = " ".join(m for m, on in (("LATEST", v["version"] == report["latest"]), ("PIN", pin and v["version"] == pin["version"])) if on)
        lines.append(f"  {v['version']:>8} {v['kind']:5} {v['parent'] if v['parent'] is not None else '-':>8} {created:19} "
                     f"{v['rows']:>11,} {v['bytes']:>13,}  {mark}")
    return "\n".join(lines)
