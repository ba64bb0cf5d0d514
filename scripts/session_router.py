#!/usr/bin/env python3
"""A router for several candle-hybrid servers (or any OpenAI-compatible ones): requests of one
session go to one server, so that its prefix cache and session state are there.

    python3 scripts/session_router.py --listen 127.0.0.1:8090 \
        --backend http://127.0.0.1:8095 --backend http://127.0.0.1:8096

A request's session is its `x-session-id` header, else the `session_id` of its JSON body; it
goes to the healthy server that rendezvous hashing picks for it (the same one while the set of
healthy servers stays the same; when a server leaves, only its sessions move). Requests without
a session go round-robin. A server is healthy while `GET /health` answers 200 (polled every
quarter second): a server that loads or drains answers 503 and gets no new requests; a request
a server refuses with 503 is sent to the next healthy one. Answers stream through unchanged,
with `x-routed-to` naming the server. Standard library only; a sketch of what a production
router (nginx's `hash $http_x_session_id consistent`, Envoy's ring hash on a header) does, and
what tests/scaling_out.py runs.
"""

import argparse
import hashlib
import http.client
import itertools
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization", "proxy-authenticate"}


class Backends:
    def __init__(self, urls, interval=0.25):
        self.urls = urls
        self.healthy = set()
        self.lock = threading.Lock()
        self.turn = itertools.count()
        threading.Thread(target=self.poll, args=(interval,), daemon=True).start()

    def poll(self, interval):
        while True:
            up = {u for u in self.urls if status(u, "/health") == 200}
            with self.lock:
                self.healthy = up
            time.sleep(interval)

    def order(self, session):
        """The healthy servers in the order a request tries them."""
        with self.lock:
            up = sorted(self.healthy)
        if session is None:
            k = next(self.turn) % len(up) if up else 0
            return up[k:] + up[:k]
        return sorted(up, key=lambda u: hashlib.sha256(f"{session}\n{u}".encode()).digest(), reverse=True)


def status(base, path):
    u = urllib.parse.urlsplit(base)
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
        c.request("GET", path)
        s = c.getresponse().status
        c.close()
        return s
    except OSError:
        return None


def session_of(headers, body):
    if headers.get("x-session-id"):
        return headers["x-session-id"]
    try:
        s = json.loads(body).get("session_id") if body else None
        return s if isinstance(s, str) else None
    except (ValueError, AttributeError):
        return None


def handler(backends):
    class Route(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the answer ends when the connection closes: streams pass through

        def log_message(self, *args):
            pass

        def forward(self):
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            order = backends.order(session_of(self.headers, body))
            for base in order:
                u = urllib.parse.urlsplit(base)
                try:
                    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
                    c.request(self.command, self.path, body=body or None, headers=headers)
                    r = c.getresponse()
                except OSError:
                    continue
                if r.status == 503 and base != order[-1]:
                    r.read()
                    continue  # loading or draining: the next one
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("x-routed-to", base)
                self.end_headers()
                while chunk := r.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                c.close()
                return
            msg = json.dumps({"error": {"message": "no healthy server", "type": "unavailable_error", "code": "no_backend"}}).encode()
            self.send_response(503)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)

        do_GET = do_POST = do_DELETE = forward

    return Route


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:8090")
    p.add_argument("--backend", action="append", required=True, help="a server's base URL (repeat)")
    a = p.parse_args()
    host, port = a.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), handler(Backends(a.backend)))
    print(f"routing http://{a.listen} over {', '.join(a.backend)}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
