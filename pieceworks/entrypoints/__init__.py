"""Entry points: the ``pieceworks`` command line (``cli``) and its subcommands."""
