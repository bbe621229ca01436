"""The engine: model runner (buffers, capture, execute), scheduler, sampler and the LLM API."""
