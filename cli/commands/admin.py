"""`switchyard admin`: every admin endpoint of the gateway, from the command line.

    tenant create|show|update|replace|delete|list     /admin/tenants
    key create|list|revoke                            /admin/tenants/{id}/keys, /admin/keys
    routing show|set|replace|audit                    /admin/routing
    usage [--tenant T] [--by model|day|hour|key]      /admin/usage (table, --csv, --json)
    fleet                                             /admin/fleet

The admin key: --admin-key, --admin-key-file, $SWITCHYARD_ADMIN_KEY, $SWITCHYARD_ADMIN_KEY_FILE,
else the key a local `switchyard serve` stored. The older spellings (create-tenant,
create-key, list-tenants, revoke-key) still work.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from cli.admin_view import LIMITS, render_table, render_usage, tenant_body


def _add_limits(p: argparse.ArgumentParser, clearable: bool) -> None:
    for limit in LIMITS:
        p.add_argument(f"--{limit.replace('_', '-')}", dest=limit, type=int, default=None)
    p.add_argument("--name")
    p.add_argument("--model", action="append", help="allowed pool (repeatable; default: all)")
    over = p.add_mutually_exclusive_group()
    over.add_argument("--overflow", dest="allow_overflow", action="store_true", default=None)
    over.add_argument("--no-overflow", dest="allow_overflow", action="store_false")
    p.add_argument(
        "--priority-ceiling",
        type=int,
        default=None,
        metavar="N",
        help="the most urgent `priority` its requests may ask (lower is more urgent; default 0)",
    )
    if clearable:
        p.add_argument(
            "--clear",
            action="append",
            default=[],
            metavar="FIELD",
            help="set a limit (e.g. max_concurrent), `allowed_models`, `name`, `allow_overflow` "
            "or `priority_ceiling` back to its default (repeatable)",
        )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    admin = subparsers.add_parser(
        "admin", help="tenants, keys, routing, usage and fleet (admin API)"
    )
    admin.add_argument(
        "--url", default=None, help="the gateway (default: the local `switchyard serve`; :8000)"
    )
    admin.add_argument("--admin-key", default=None, help="default: $SWITCHYARD_ADMIN_KEY")
    admin.add_argument("--admin-key-file", default=None, help="a file holding the admin key (0600)")
    admin.add_argument("--json", action="store_true", help="print the raw JSON answers")
    acts = admin.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)  # --json after the command, too
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS)

    tenant = acts.add_parser("tenant", help="create, show, update, replace, delete, list")
    t = tenant.add_subparsers(dest="op", required=True)
    for op in ("create", "replace"):
        p = t.add_parser(
            op, help="replace: the whole document (left out: defaults)", parents=[common]
        )
        p.add_argument("tenant")
        _add_limits(p, clearable=False)
    p = t.add_parser("update", help="change only the fields given (PATCH)", parents=[common])
    p.add_argument("tenant")
    _add_limits(p, clearable=True)
    for op in ("show", "delete"):
        t.add_parser(op, parents=[common]).add_argument("tenant")
    t.add_parser("list", parents=[common])

    key = acts.add_parser("key", help="create, list, revoke")
    k = key.add_subparsers(dest="op", required=True)
    p = k.add_parser("create", help="the key is printed once", parents=[common])
    p.add_argument("tenant")
    p.add_argument("--name")
    p.add_argument("--expires-in", type=float, default=None, metavar="DAYS")
    for limit in LIMITS:  # the key's own limits, on top of its tenant's
        p.add_argument(f"--{limit.replace('_', '-')}", dest=limit, type=int, default=None)
    k.add_parser("list", parents=[common]).add_argument("tenant")
    k.add_parser("revoke", parents=[common]).add_argument("key_id")

    routing = acts.add_parser("routing", help="show, set (merge), replace, audit")
    r = routing.add_subparsers(dest="op", required=True)
    r.add_parser("show", parents=[common])
    p = r.add_parser(
        "set", help="FIELD=JSON ... merged into the settings (PATCH)", parents=[common]
    )
    p.add_argument("assignments", nargs="+", metavar="FIELD=JSON")
    p = r.add_parser("replace", help="the whole settings from a JSON file (PUT)", parents=[common])
    p.add_argument("file")
    r.add_parser("audit", parents=[common])

    usage = acts.add_parser(
        "usage", help="usage by tenant, model, day, hour or key", parents=[common]
    )
    usage.add_argument("--tenant")
    usage.add_argument("--by", default="day", choices=["model", "day", "hour", "key"])
    usage.add_argument("--start", help="unix seconds or ISO date (default: 7 days ago)")
    usage.add_argument("--end", help="unix seconds or ISO date (default: now)")
    usage.add_argument("--csv", action="store_true", help="CSV instead of a table")

    acts.add_parser(
        "fleet", help="pools, replicas and their state, the autoscaler's decision", parents=[common]
    )

    ct = acts.add_parser("create-tenant", help="= tenant create")
    ct.add_argument("tenant")
    _add_limits(ct, clearable=False)
    ck = acts.add_parser("create-key", help="= key create")
    ck.add_argument("tenant")
    ck.add_argument("--name")
    ck.add_argument("--expires-in", type=float, default=None, metavar="DAYS")
    acts.add_parser("list-tenants", help="= tenant list")
    acts.add_parser("revoke-key", help="= key revoke").add_argument("key_id")
    admin.set_defaults(run=run)


def admin_key(args: argparse.Namespace, url: str) -> str | None:
    from cli.commands.models import cache_dir
    from cli.serve.state import local_admin_key

    path = args.admin_key_file or os.environ.get("SWITCHYARD_ADMIN_KEY_FILE")
    if args.admin_key:
        return args.admin_key
    if path:
        return Path(path).expanduser().read_text().strip() or None
    return os.environ.get("SWITCHYARD_ADMIN_KEY") or local_admin_key(cache_dir(None), url)


def run(args: argparse.Namespace) -> int:
    """Open a client on the gateway's /admin, then dispatch on (action, op) in `_run`."""
    import httpx

    from cli.commands.models import cache_dir
    from cli.serve.state import local_stack

    stack = local_stack(cache_dir(None))
    url = (args.url or (stack["url"] if stack else "http://127.0.0.1:8000")).rstrip("/")
    try:
        key = admin_key(args, url)
    except OSError as exc:
        print(f"error: cannot read the admin key file: {exc}", file=sys.stderr)
        return 2
    if not key:
        print(
            f"error: no admin key for {url}: give --admin-key or --admin-key-file, or set "
            "SWITCHYARD_ADMIN_KEY (`switchyard serve` stores one in its data_dir/admin-key)",
            file=sys.stderr,
        )
        return 2
    client = httpx.Client(
        base_url=url + "/admin", headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    try:
        with client:
            return _run(args, client)
    except httpx.TransportError as exc:
        print(
            f"error: cannot reach the gateway at {url} ({type(exc).__name__}); "
            "is `switchyard serve` running? (--url to point elsewhere)",
            file=sys.stderr,
        )
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, c: Any) -> int:  # noqa: C901 (one dispatch table)
    action, op = args.action, getattr(args, "op", None)
    aliases = {
        "create-tenant": ("tenant", "create"),
        "create-key": ("key", "create"),
        "list-tenants": ("tenant", "list"),
        "revoke-key": ("key", "revoke"),
    }
    legacy = action in aliases
    if legacy:
        action, op = aliases[action]
    table = None  # how to print a success when not --json
    if action == "tenant":
        if op == "create":
            r = c.post("/tenants", json={"tenant_id": args.tenant, **tenant_body(args)})
        elif op == "update":
            r = c.patch(f"/tenants/{args.tenant}", json=tenant_body(args, partial=True))
        elif op == "replace":
            r = c.put(f"/tenants/{args.tenant}", json=tenant_body(args))
        elif op == "show":
            r = c.get(f"/tenants/{args.tenant}")
        elif op == "delete":
            r = c.delete(f"/tenants/{args.tenant}")
        else:
            r = c.get("/tenants")
            table = ("tenants", lambda d: d["data"])
    elif action == "key":
        if op == "create":
            body: dict[str, Any] = {"name": args.name}
            if args.expires_in is not None:
                import time

                body["expires_at"] = time.time() + args.expires_in * 86400
            own = {k: getattr(args, k, None) for k in LIMITS}
            if any(v is not None for v in own.values()):
                body["limits"] = {k: v for k, v in own.items() if v is not None}
            r = c.post(f"/tenants/{args.tenant}/keys", json=body)
        elif op == "list":
            r = c.get(f"/tenants/{args.tenant}/keys")
            table = ("keys", lambda d: d["data"])
        else:
            r = c.delete(f"/keys/{args.key_id}")
    elif action == "routing":
        if op == "show":
            r = c.get("/routing")
        elif op == "set":
            r = c.patch("/routing", json=_assignments(args.assignments))
        elif op == "replace":
            r = c.put("/routing", json=json.loads(Path(args.file).read_text()))
        else:
            r = c.get("/routing/audit")
            table = ("audit", lambda d: d["data"])
    elif action == "usage":
        params = {"group_by": args.by, "start": args.start, "end": args.end, "tenant": args.tenant}
        params = {k: v for k, v in params.items() if v}
        if args.csv:
            params["format"] = "csv"
        r = c.get("/usage", params=params)
        if r.status_code == 200 and args.csv:
            sys.stdout.write(r.text)
            return 0
        table = ("usage", None)
    else:
        r = c.get("/fleet")
        if r.status_code == 200 and not args.json:
            from cli.fleet_view import render_fleet

            print(render_fleet(r.json()))
            return 0
        table = None
    return _print(r, args, table, legacy)


def _assignments(items: list[str]) -> dict[str, Any]:
    """FIELD=JSON pairs; a dotted FIELD nests (tenant_thresholds.acme=0.3)."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise ValueError(f"expected FIELD=JSON, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word: a string
        target = out
        *parents, last = name.split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[last] = value
    return out


def _print(r: Any, args: argparse.Namespace, table: tuple | None, legacy: bool) -> int:
    try:
        doc = r.json()
    except ValueError:
        doc = {"error": {"message": r.text.strip() or f"HTTP {r.status_code}"}}
    if r.status_code >= 400:
        err = doc.get("error", {}) if isinstance(doc, dict) else {}
        where = f" ({err['param']})" if err.get("param") else ""
        print(f"error: {r.status_code} {err.get('message', doc)}{where}", file=sys.stderr)
        return 1
    if args.json or legacy or table is None:
        print(json.dumps(doc, indent=2))
    elif table[0] == "usage":
        print(render_usage(doc, args.by))
    else:
        print(render_table(table[0], table[1](doc)))
    if "key" in doc and isinstance(doc.get("key"), str):
        print("\nThe key above is shown once; store it now.", file=sys.stderr)
    return 0
