"""The compile pipeline: decorator -> trace once -> split -> compile pieces -> static graphs.

Knows nothing about hardware: it asks ``current_platform()`` for the graph wrapper, pool and
dispatch key. See ``docs/design.md`` for the whole path from decorator to replay.
"""
