"""The front of the engine: the engine core that steps the scheduler and the executor
(``core.py``), its command loop (``core_loop.py``) with typed messages (``messages.py``), the
engine process (``core_process.py``) and its clients (``core_client.py``), the async engine,
output processing, the ``LLM`` API, tokenizers and detokenization."""
