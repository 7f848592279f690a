"""A stand-in for a rollout server (or the router) behind a proxy that redirects: started in place
of the server's command line, it listens on the `--host`/`--port` given there, answers
$REDIRECT_CODE (default 307) to each path in $REDIRECT_PATHS (comma-separated), pointing at
$REDIRECT_TO plus the path, 200 with a JSON object of 64 MiB to each path in $LONG_PATHS (a
proxy's padded answer), $ODD_STATUS (default 200) with the body $ODD_BODY to each path in
$ODD_PATHS (a proxy's page, a server's failure), and 200 with `{}` to anything else. It exits by
itself after 60 s, so none outlives a failed test."""

from __future__ import annotations

import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> None:
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    port = int(argv[argv.index("--port") + 1])
    redirected = set(os.environ.get("REDIRECT_PATHS", "").split(","))
    target = os.environ["REDIRECT_TO"]
    code = int(os.environ.get("REDIRECT_CODE", "307"))
    long = set(os.environ.get("LONG_PATHS", "").split(","))
    odd = set(os.environ.get("ODD_PATHS", "").split(","))
    odd_status, odd_body = int(os.environ.get("ODD_STATUS", "200")), os.environ.get("ODD_BODY", "")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path in redirected:
                self.send_response(code)
                self.send_header("Location", target + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path in long:
                return self.long_answer()
            if self.path in odd:
                return self.answer(odd_status, odd_body.encode())
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def answer(self, status: int, body: bytes):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def long_answer(self):
            head, tail, chunk = b'{"pad": "', b'"}', b"x" * (1 << 20)
            self.send_response(200)
            self.send_header("Content-Length", str(len(head) + 64 * len(chunk) + len(tail)))
            self.end_headers()
            try:
                self.wfile.write(head)
                for _ in range(64):
                    self.wfile.write(chunk)
                self.wfile.write(tail)
            except OSError:  # (the client hung up)
                pass

        def log_message(self, *args):
            pass

    threading.Timer(60, os._exit, args=(0,)).start()
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
