"""The aiohttp service: legacy HTTP API, WebSocket directing channel, static studio UI.

The app is built by :func:`moss_rt.web.app.create_app`. This package file imports nothing: the layers that
the web modules build on (scripts, words) import single web modules, and importing the package must not pull
in the whole app behind them (that was an import cycle: app → scripts → web).
"""
