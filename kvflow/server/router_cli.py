"""`kvflow router --backends URL,URL,...`: the router (kvflow/server/router.py) in the
foreground. Building the parser imports argparse only; FastAPI and httpx load on use."""
from __future__ import annotations

import os

from kvflow.core.routing import POLICIES         # pure Python, already loaded by kvflow.cli
from kvflow.server.http_common import add_http_args


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="route OpenAI requests to data-parallel replicas")
    p.add_argument("--backends", required=True,
                   help="comma-separated base URLs of the replicas (http://host:port,...)")
    p.add_argument("--policy", default="prefix", choices=POLICIES,
                   help="prefix: the replica most likely to hold the prompt's prefix, unless "
                        "the load gap is too wide (default); round_robin; least_load")
    add_http_args(p)
    p.add_argument("--backend-api-key", default=None,
                   help="key sent to the replicas (default: the --api-key)")
    p.add_argument("--backend-timeout", type=float, default=600.0,
                   help="seconds to connect to a replica, and between bytes of its answer; "
                        "a late one is a 504 (default: 600)")
    p.add_argument("--health-check-interval", type=float, default=5.0,
                   help="seconds between GETs of each replica's /health (default: 5)")
    p.add_argument("--health-check-timeout", type=float, default=2.0,
                   help="seconds a replica has to answer a health check (default: 2)")
    p.add_argument("--health-failure-threshold", type=int, default=2,
                   help="failed checks in a row that take a replica out (default: 2)")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="prefix: the matched share of a prompt above which it goes to the "
                        "matching replica (default: 0.5)")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="prefix: route by load when the busiest replica has this many more "
                        "requests in flight than the idlest ... (default: 32)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and this many times as many (default: 1.5)")
    p.set_defaults(func=cmd_router)


def parse_backends(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("--backends: give at least one URL")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"--backends: not an http(s) URL: {bad[0]!r}")
    if len(set(urls)) != len(urls):
        raise ValueError("--backends: a URL is given twice")
    return urls


def cmd_router(args) -> int:
    policy_kw = {}
    if args.policy == "prefix":
        policy_kw = dict(cache_threshold=args.cache_threshold,
                         balance_abs_threshold=args.balance_abs_threshold,
                         balance_rel_threshold=args.balance_rel_threshold)
    key = args.backend_api_key if args.backend_api_key is not None else args.api_key
    return run_router(args, parse_backends(args.backends), args.policy, backend_api_key=key,
                      backend_timeout=args.backend_timeout,
                      health_check_interval=args.health_check_interval,
                      health_check_timeout=args.health_check_timeout,
                      health_failure_threshold=args.health_failure_threshold,
                      policy_kw=policy_kw)


def run_router(args, urls: list[str], policy: str, **router_kw) -> int:
    """Serve the router on args.host/port with args' HTTP limits (see add_http_args) until
    SIGTERM/Ctrl-C."""
    import sys

    from kvflow.server.http_server import make_server
    from kvflow.server.router import build_router_app
    app = build_router_app(urls, policy, api_key=args.api_key,
                           max_body_bytes=args.max_request_body_bytes,
                           public_metrics=args.metrics_no_auth, **router_kw)
    print(f"kvflow router: {policy} over {', '.join(urls)} on http://{args.host}:{args.port} "
          f"(pid {os.getpid()})", file=sys.stderr)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level,
                         header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                         shutdown_timeout=args.shutdown_timeout)
    try:
        server.run()
    except KeyboardInterrupt:       # uvicorn re-raises the Ctrl-C it shut down for
        pass
    return 0 if server.started else 3
