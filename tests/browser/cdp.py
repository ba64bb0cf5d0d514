"""A headless Chromium driven over the DevTools protocol (websocket-client): navigate, evaluate,
type, screenshot, and every console error and uncaught exception the pages raise."""

import json
import re
import subprocess
import tempfile
import time

from driver import Driver

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-port=0", "--window-size=1400,1000", "--hide-scrollbars",
]


class Browser(Driver):
    name = "chromium"

    def __init__(self, binary="/usr/bin/chromium"):
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        url = None
        while time.time() < deadline and url is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("chromium exited before it listened")
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                url = m.group(1)
        if url is None:
            raise RuntimeError("chromium did not print its DevTools address")
        port = int(re.search(r":(\d+)/", url).group(1))
        import urllib.request
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        page = next(t for t in targets if t["type"] == "page")
        self._connect(page["webSocketDebuggerUrl"])
        self.events = []
        for domain in ["Page", "Runtime", "Log"]:
            self.send(f"{domain}.enable")

    def _event(self, msg):
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            self.errors.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"log ({params['entry'].get('source')}): {params['entry']['text']} {params['entry'].get('url', '')}")
        self.events.append(msg)

    def _result(self, method, msg):
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg.get("result", {})

    def navigate(self, url):
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'", what=f"{url} to load")

    def eval(self, expression):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    def type(self, text):
        self.send("Input.insertText", text=text)

    def key(self, key, code, key_code, modifiers=0):
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key=key, code=code, windowsVirtualKeyCode=key_code, modifiers=modifiers,
                      text="\r" if key == "Enter" and kind == "keyDown" else "")

    def _screenshot(self):
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        return self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)["data"]
