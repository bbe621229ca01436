"""The front of the engine: the step loop, the engine core and its process with typed messages,
the async engine, output processing, the ``LLM`` API, tokenizers and detokenization."""
