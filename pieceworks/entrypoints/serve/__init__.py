"""``pieceworks serve MODEL``: the OpenAI-compatible server (SPEC section 9).

``cmd_serve`` starts the engine from the model and the engine flags (``LLM``'s arguments) in a
process of its own (``engine/core_process.py``; ``--engine-in-process`` keeps it on a thread of
the server, for debugging), puts it behind an ``AsyncLLMEngine`` and serves it with
``api_server``; the flags follow ``vllm serve``. The server process loads only the tokenizer.
Nothing here is imported unless the ``serve`` subcommand runs, so the optional ``serve`` extra
(fastapi, uvicorn, prometheus_client) is needed only to serve.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    compilation_fields,
    default_model,
    engine_args,
)


def build_context(llm: Any, model_name: str, max_waiting_requests: int) -> Any:
    """The ``ServingContext`` over an ``LLM``'s engine, run on a thread of this process."""
    from pieceworks.engine.core_client import InprocEngineClient

    engine = llm.engine
    model_config = llm.config.model_config
    limits = _limits(
        model_config.max_model_len,
        model_config.hf_config.get("vocab_size"),
        engine.scheduler.block_manager.num_tokens_capacity,
    )
    client = InprocEngineClient(engine)
    return _context(client, llm.tokenizer, model_name, limits, max_waiting_requests)


def build_process_context(spec: Any, model_name: str, max_waiting_requests: int) -> Any:
    """The ``ServingContext`` over an engine built from ``spec`` (an ``EngineSpec``) in a
    process of its own; an engine that cannot be built raises its error here."""
    from pieceworks.engine.core_client import EngineProcessClient
    from pieceworks.engine.tokenizer import check_tokenizer_fits, load_tokenizer

    client = EngineProcessClient(spec)
    try:
        info = client.info
        tokenizer = load_tokenizer(spec.model, spec.engine_args.get("tokenizer"))
        check_tokenizer_fits(tokenizer, info.vocab_size, spec.engine_args.get("tokenizer"))
    except BaseException:
        client.shutdown()
        raise
    limits = _limits(info.max_model_len, info.vocab_size, info.kv_capacity_tokens)
    return _context(client, tokenizer, model_name, limits, max_waiting_requests)


def _limits(max_model_len: int, vocab_size: int | None, kv_capacity_tokens: int) -> Any:
    from pieceworks.entrypoints.serve.validation import ModelLimits

    return ModelLimits(max_model_len, vocab_size, kv_capacity_tokens)


def _context(
    client: Any, tokenizer: Any, model_name: str, limits: Any, max_waiting_requests: int
) -> Any:
    from pieceworks.engine.async_engine import AsyncLLMEngine
    from pieceworks.engine.detokenizer import prepare_decoding
    from pieceworks.engine.tokenizer import apply_chat_template
    from pieceworks.entrypoints.serve.metrics import ServerMetrics
    from pieceworks.entrypoints.serve.serving import ServingContext

    if tokenizer is not None:
        prepare_decoding(tokenizer)  # the tokens' texts, before the first request waits on them
    engine = AsyncLLMEngine(client, max_waiting_requests=max_waiting_requests)
    render = functools.partial(apply_chat_template, tokenizer)
    return ServingContext(engine, tokenizer, model_name, limits, ServerMetrics(model_name), render)


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the engine (its own process unless ``--engine-in-process``), then serve it until
    SIGINT/SIGTERM."""
    try:
        from pieceworks.entrypoints.serve.api_server import build_app, serve
    except ImportError as error:
        raise RuntimeError(
            f"serving needs the 'serve' extra ({error.name} is missing): "
            "pip install 'pieceworks[serve]'"
        ) from None
    from pieceworks.engine.core_process import EngineSpec

    model = args.model_tag or args.model
    spec = EngineSpec(model, compilation_fields(args) or None, engine_args(args))
    names = args.served_model_name or [model]
    if args.engine_in_process:
        from pieceworks.engine.llm import LLM

        llm = LLM(spec.model, compilation_config=spec.compilation_config, **spec.engine_args)
        ctx = build_context(llm, names[0], args.max_waiting_requests)
    else:
        ctx = build_process_context(spec, names[0], args.max_waiting_requests)
    try:
        app = build_app(
            ctx,
            names,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
        )
        serve(app, args.host, args.port, args.uvicorn_log_level)
    finally:
        ctx.engine.shutdown()  # already done when the app shut down; not when uvicorn failed
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
        "--engine-in-process",
        action="store_true",
        help="run the engine on a thread of the server process instead of its own process "
        "(debugging: it then shares the interpreter lock with the HTTP side)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="how tool calls are found in free text (tool_choice auto): hermes reads "
        "<tool_call>{json}</tool_call>, llama3_json a {name, parameters} object",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests send tool_choice "auto" (needs --tool-call-parser)',
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.set_defaults(func=cmd_serve)
