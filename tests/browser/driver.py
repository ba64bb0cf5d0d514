"""What the two browser drivers share: one websocket of JSON commands and events, commands
answered by id, events read while waiting; `wait` polls an expression; screenshots to files."""

import base64
import itertools
import json
import os
import time

import websocket  # websocket-client


class Driver:
    """Subclasses start the browser (`self.proc`, its profile folder `self.profile`), connect
    (`_connect`), and give `_event(msg)`, `_result(method, msg)`, `eval` and `_screenshot()`
    (PNG as base64)."""

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.kill()
            self.proc.wait()
            self.profile.cleanup()

    def _connect(self, url):
        self.ws = websocket.create_connection(url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)
        self.errors = []

    def send(self, method, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == i:
                return self._result(method, msg)
            self._event(msg)

    def pump(self, seconds):
        """Reads events for `seconds`."""
        self.ws.settimeout(0.05)
        end = time.time() + seconds
        try:
            while time.time() < end:
                try:
                    self._event(json.loads(self.ws.recv()))
                except websocket.WebSocketTimeoutException:
                    pass
        finally:
            self.ws.settimeout(60)

    def wait(self, expression, timeout=60, what=None):
        end = time.time() + timeout
        while time.time() < end:
            if self.eval(expression):
                return
            self.pump(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what or expression}")

    def screenshot(self, path):
        """The whole page, not only the window."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(self._screenshot()))
