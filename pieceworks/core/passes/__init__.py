"""pieceworks' Inductor passes: run on the post-grad graph of every compiled piece.

``PostGradPassManager`` (``pass_manager.py``) is what Inductor calls, as its
``post_grad_custom_post_pass``; it runs, as ``PassConfig`` asks, no-op elimination
(``noop_elimination.py``), the RMSNorm + static FP8 quant fusion (``fusion.py``), and always last
the rewrite of functionalized pieceworks ops back into in-place calls
(``fix_functionalization.py``). Every pass has a ``uuid()`` over its source and configuration
(``inductor_pass.py``); the manager's enters the compile-cache key. See ``docs/passes.md``.
"""
