"""Scale-out on Ray: one engine replica per GPU behind the unchanged aiohttp front end (docs/cluster.md).

Nothing here is imported in single-process mode; Ray is only needed with ``serve --cluster``.
"""
