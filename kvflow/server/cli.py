"""`kvflow serve`: the OpenAI-compatible server in the foreground (FastAPI + uvicorn)."""
from __future__ import annotations

import os
import sys

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    p.add_argument("model_tag", nargs="?", default=None,
                   help="model path, as in `vllm serve MODEL` (same as --model)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $KVFLOW_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use (default: the model path's basename, or "
                        f"{DEFAULT_SERVED_NAME} for the embedded model)")
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_SERVED_NAME
    return os.path.basename(os.path.normpath(model)) or model


def cmd_serve(args) -> int:
    import uvicorn

    from kvflow.cli import engine_kwargs
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.engine.llm_engine import EngineArgs
    from kvflow.server.api_server import build_app

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model, **engine_kwargs(args)))
    names = args.served_model_name or [served_name(model)]
    if model is None:
        from kvflow.model.gguf_loader import default_model_path
        path = default_model_path()
    else:
        path = model
    app = build_app(llm, names, api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes, model_path=path)
    c = llm.scheduler_config
    print(f"kvflow serve: {names[0]} on http://{args.host}:{args.port} (max_model_len "
          f"{c.max_model_len}, {c.num_blocks} KV blocks of {c.block_size}, max_num_seqs "
          f"{c.max_num_seqs}, load {llm.engine.load_time:.1f} s)", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5))
    # A failed step leaves nothing to serve: stop (in-flight requests get their error) and exit
    # non-zero so that a supervisor restarts the server, rather than answer 503 forever.
    llm.on_engine_dead(lambda err: setattr(server, "should_exit", True))
    try:
        server.run()
    except KeyboardInterrupt:       # uvicorn re-raises the Ctrl-C it handled, as uvicorn.run
        pass
    finally:
        llm.shutdown()
    if llm.step_error is not None:
        print(f"kvflow serve: the engine failed ({llm.step_error!r}); exiting", file=sys.stderr)
        return 1
    return 0 if server.started else 3       # 3: uvicorn.run's exit code for a failed startup
