"""``pieceworks serve MODEL``: the OpenAI-compatible server (SPEC section 9).

``cmd_serve`` builds the engine from the model and the engine flags (``LLM``'s arguments), puts
it behind an ``AsyncLLMEngine`` and serves it with ``api_server``; the flags follow
``vllm serve``. Nothing here is imported unless the ``serve`` subcommand runs, so the optional
``serve`` extra (fastapi, uvicorn, prometheus_client) is needed only to serve.
"""

from __future__ import annotations

import argparse
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    compilation_fields,
    default_model,
    engine_args,
)


def build_context(llm: Any, model_name: str, max_waiting_requests: int) -> Any:
    """The ``ServingContext`` over an ``LLM``'s engine and tokenizer."""
    from pieceworks.engine.async_engine import AsyncLLMEngine
    from pieceworks.entrypoints.serve.metrics import ServerMetrics
    from pieceworks.entrypoints.serve.serving import ServingContext
    from pieceworks.entrypoints.serve.validation import ModelLimits

    model_config = llm.config.model_config
    kv_tokens = llm.engine.scheduler.block_manager.num_tokens_capacity
    vocab_size = model_config.hf_config.get("vocab_size")
    limits = ModelLimits(model_config.max_model_len, vocab_size, kv_tokens)
    engine = AsyncLLMEngine(llm.engine, max_waiting_requests=max_waiting_requests)
    metrics = ServerMetrics(model_name)
    return ServingContext(
        engine, llm.tokenizer, model_name, limits, metrics, llm.apply_chat_template
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve it until SIGINT/SIGTERM."""
    try:
        from pieceworks.entrypoints.serve.api_server import build_app, serve
    except ImportError as error:
        raise RuntimeError(
            f"serving needs the 'serve' extra ({error.name} is missing): "
            "pip install 'pieceworks[serve]'"
        ) from None
    from pieceworks.engine.llm import LLM

    model = args.model_tag or args.model
    llm = LLM(model, compilation_config=compilation_fields(args) or None, **engine_args(args))
    names = args.served_model_name or [model]
    ctx = build_context(llm, names[0], args.max_waiting_requests)
    app = build_app(ctx, names, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    serve(app, args.host, args.port, args.uvicorn_log_level)
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    parser.add_argument("model_tag", nargs="?", default=None, help="the model (as --model)")
    add_engine_args(parser, default_model())
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="clients must send 'Authorization: Bearer <key>'"
    )
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) the API answers to"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued beyond max_num_seqs before new ones get 503",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.set_defaults(func=cmd_serve)
