"""uvicorn's `Server` for `quantkit serve`: a stop ends the requests first, then lets uvicorn close.

On SIGTERM or SIGINT (or `should_exit`), uvicorn stops listening, waits up to its graceful timeout for the
connections, then cancels what is left (a 500, a stream cut mid-chunk, a CancelledError traceback). Here the
app's `shutdown` (quantkit/server/app.py: new requests 503, bodies being read cut off, every waiting and running
request ended with a 503 or a stream's error event and `[DONE]`) runs first, so the connections close at once
and the lifespan's end (the worker joined, the disk prompt cache flushed) follows well inside that timeout.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any):
        super().__init__(config)
        self._app = app  # the FastAPI app (config.app may be wrapped by uvicorn's middleware once loaded)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stop = getattr(getattr(self._app, "state", None), "shutdown", None)
        if stop is not None:
            stop()
        await super().shutdown(sockets)
