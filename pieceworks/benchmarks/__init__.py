"""The product benchmarks behind ``pieceworks bench ...``: latency per mode, the peers it is
compared with (``baselines``), and the tables, JSON and plots they print (``report``).

This package sits above ``engine`` (it drives ``LLM``) and below ``entrypoints`` (the CLI calls it).
The top-level ``benchmarks/`` folder of the repository holds the kernel micro-benchmarks and
profiles a user reruns by hand.
"""
