"""The engine: model runner (buffers, capture, execute), scheduler, sampler, LLM API and CLI."""
