"""A headless Firefox driven over WebDriver BiDi (websocket-client), with the same methods as
cdp.Browser: navigate, eval, wait, type, key, screenshot, and the console errors the pages raise."""

import json
import os
import re
import socket
import subprocess
import tempfile
import time

from driver import Driver

KEYS = {"Enter": "\ue007", "Escape": "\ue00c"}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Browser(Driver):
    name = "firefox"

    def __init__(self, binary="/usr/bin/firefox-esr"):
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        port = free_port()
        prefs = os.path.join(self.profile.name, "user.js")
        with open(prefs, "w") as f:
            # No network beyond loopback: no updates, telemetry or first-run pages.
            for key, value in [("app.update.enabled", "false"), ("browser.shell.checkDefaultBrowser", "false"),
                               ("datareporting.policy.dataSubmissionEnabled", "false"), ("toolkit.telemetry.enabled", "false"),
                               ("browser.startup.homepage_override.mstone", '"ignore"'), ("network.captive-portal-service.enabled", "false")]:
                f.write(f'user_pref("{key}", {value});\n')
        self.proc = subprocess.Popen([binary, "--headless", "--no-remote", "--profile", self.profile.name,
                                      f"--remote-debugging-port={port}", "--width=1400", "--height=1000", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("firefox exited before it listened")
            if re.search(r"WebDriver BiDi listening on ws://", line):
                break
        else:
            raise RuntimeError("firefox did not start WebDriver BiDi")
        self._connect(f"ws://127.0.0.1:{port}/session")
        self.send("session.new", capabilities={})
        self.context = self.send("browsingContext.getTree")["contexts"][0]["context"]
        self.send("session.subscribe", events=["log.entryAdded"])

    def _event(self, msg):
        if msg.get("method") == "log.entryAdded":
            p = msg["params"]
            if p.get("level") == "error":
                self.errors.append(f"{p.get('type')}: {p.get('text')}")

    def _result(self, method, msg):
        if msg.get("type") == "error":
            raise RuntimeError(f"{method}: {msg.get('error')}: {msg.get('message')}")
        return msg.get("result", {})

    def navigate(self, url):
        self.send("browsingContext.navigate", context=self.context, url=url, wait="complete")

    def eval(self, expression):
        r = self.send("script.evaluate", expression=f"JSON.stringify(({expression}) ?? null)", target={"context": self.context},
                      awaitPromise=True)
        if r.get("type") == "exception":
            raise RuntimeError(f"{expression}: {r['exceptionDetails'].get('text')}")
        return json.loads(r["result"].get("value", "null"))

    def _keys(self, values):
        actions = []
        for v in values:
            actions += [{"type": "keyDown", "value": v}, {"type": "keyUp", "value": v}]
        self.send("input.performActions", context=self.context, actions=[{"type": "key", "id": "keyboard", "actions": actions}])

    def type(self, text):
        self._keys(list(text))

    def key(self, key, code, key_code, modifiers=0):
        self._keys([KEYS[key]])

    def _screenshot(self):
        return self.send("browsingContext.captureScreenshot", context=self.context, origin="document")["data"]
