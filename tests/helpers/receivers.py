"""Local stand-ins for what the supervisor talks to outside: an alert service (HTTP), systemd's notify socket."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)  # when it arrived

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """A local HTTP server in a thread that records every POST (an alert service stand-in).

    ``status`` is what it answers; ``hang`` makes it never answer (until closed); ``answer(request)``, when
    given, decides each answer's status and headers, as the real service would (a 429 with Retry-After, a
    400 for one number of a Twilio hook, ...).
    """

    def __init__(self, status: int = 200, hang: bool = False,
                 answer: Callable[[Received], tuple[int, dict[str, str]]] | None = None) -> None:
        import http.server
        import threading

        self.status, self.hang, self.answer = status, hang, answer
        self.requests: list[Received] = []
        self.released = threading.Event()
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                rec.requests.append(Received(self.path, dict(self.headers), self.rfile.read(n)))
                if rec.hang:
                    rec.released.wait(60)
                    return
                status, headers = rec.answer(rec.requests[-1]) if rec.answer else (rec.status, {})
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


class Messages(list[str]):
    """Notify messages in arrival order, with ``times`` (monotonic) beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []


@contextlib.contextmanager
def notify_listener(path: Path) -> Iterator[Messages]:
    """A systemd notify socket at ``path`` that reads every message (as systemd does) into the list it yields."""
    import threading

    messages = Messages()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(0.2)
        done = threading.Event()

        def read() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    messages.append(s.recv(65536).decode())
                    messages.times.append(time.monotonic())

        reader = threading.Thread(target=read)
        reader.start()
        try:
            yield messages
        finally:
            done.set()
            reader.join()
