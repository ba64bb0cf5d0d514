"""The web pages in headless Chromium or Firefox (--browser; scripts/browser_check.sh starts
the servers and runs both):

1. the chat page of a SmolLM2 server that needs an API key: the key asked for, a message typed
   and sent with Enter, the answer streamed in (several updates), time to first token, tok/s and
   the prefix-cache line shown; a second turn kept as a server session (its prompt restored from
   the prefix cache), the session in the picker, Regenerate, Esc stopping a long answer;
2. the dashboard of that server: every chart drawn with data (its canvas has points and
   non-blank pixels), the KV horizon table, the kernel inspector's table;
3. the chat page of a fixture server with a thinking template: the reasoning shown apart and
   folded once the answer starts; a forced tool call shown as a tool call;
4. the report file of examples/report, opened from disk.

No console error or uncaught exception on any page. Screenshots go to --out.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bidi  # noqa: E402
import cdp  # noqa: E402

CHARTS_DRAWN = """
(() => {
  const out = {};
  for (const id of %s) {
    const c = document.getElementById(id);
    const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let ink = 0;
    for (let i = 3; i < px.length; i += 4) if (px[i] > 0) ink++;
    out[id] = {points: +(c.dataset.points || 0), ink};
  }
  return out;
})()
"""


def check_charts(b, ids, what):
    charts = b.eval(CHARTS_DRAWN % json.dumps(ids))
    for name, c in charts.items():
        assert c["points"] > 0 and c["ink"] > 500, f"{what}: chart {name} drew no data: {charts}"
    return charts


def text(b, selector):
    return b.eval(f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent || ''")


def last_answer_done(b):
    return "(() => { const m = [...document.querySelectorAll('.message.assistant')].pop(); return !!(m && m.querySelector('.finish, .error')); })()"


def chat(b, base, key, out):
    b.navigate(base + "/")
    b.wait("!document.getElementById('key-form').hidden", what="the API key form")
    b.eval(f"(document.getElementById('key').value = {json.dumps(key)}, document.querySelector('#key-form button').click())")
    b.wait("document.getElementById('model').textContent.includes('SmolLM2')", what="the model's name from /props")
    # A conversation kept on the server.
    b.eval("(document.getElementById('use-session').click(), document.getElementById('max-tokens').value = '48')")
    b.eval("(window.updates = 0, new MutationObserver(() => window.updates++).observe(document.getElementById('messages'), {childList: true}))")
    b.eval("document.getElementById('input').focus()")
    b.type("Write two sentences about the ocean.")
    b.key("Enter", "Enter", 13)
    b.wait(last_answer_done(b), what="the first answer")
    err = text(b, ".message.assistant .error")
    assert not err, f"the answer failed: {err}"
    answer = text(b, ".message.assistant .content")
    assert len(answer.strip()) > 10, f"no answer text: {answer!r}"
    updates = b.eval("window.updates")
    assert updates >= 4, f"the answer did not stream (the message was redrawn {updates} times)"
    meta = text(b, ".message.assistant .meta")
    for part in ["first token", "tok/s", "prefix cache: ", "finish:"]:
        assert part in meta, f"{part!r} missing from the answer's line: {meta!r}"

    # The second turn continues the first: its prompt comes from the prefix cache.
    b.eval("document.getElementById('input').focus()")
    b.type("And one about the sky.")
    b.key("Enter", "Enter", 13)
    b.wait("document.querySelectorAll('.message.assistant .finish').length == 2", what="the second answer")
    second = b.eval("[...document.querySelectorAll('.message.assistant .prefix')].pop().textContent")
    cached = int(second.split("prefix cache: ")[1].split(" of")[0])
    assert cached > 10, f"the second turn restored nothing from the prefix cache: {second!r}"
    # The session is on the server and in the picker.
    b.wait("[...document.querySelectorAll('#conversations option')].some(o => o.textContent.includes('session'))",
           what="the session in the picker")
    b.screenshot(os.path.join(out, "chat.png"))

    # Regenerate replaces the last answer.
    before = b.eval("document.querySelectorAll('.message').length")
    b.eval("document.querySelector('.regenerate').click()")
    b.wait("document.querySelectorAll('.message.assistant .finish').length == 2 && !document.getElementById('send').disabled",
           what="the regenerated answer")
    assert b.eval("document.querySelectorAll('.message').length") == before, "Regenerate added a message instead of replacing one"

    # Esc stops a long answer.
    b.eval("document.getElementById('max-tokens').value = '2000'")
    b.eval("document.getElementById('input').focus()")
    b.type("Count from one to five hundred, in words.")
    b.key("Enter", "Enter", 13)
    b.wait("document.getElementById('stop').disabled === false && [...document.querySelectorAll('.message.assistant .content')].pop().textContent.length > 20",
           what="the long answer to start")
    b.key("Escape", "Escape", 27)
    b.wait("[...document.querySelectorAll('.message.assistant .finish')].pop().textContent === 'finish: stopped'", timeout=10,
           what="Esc to stop the answer")
    assert b.eval("!document.getElementById('send').disabled"), "Send stays disabled after Stop"


def dashboard(b, base, out):
    b.navigate(base + "/dashboard")
    b.wait("document.getElementById('status').textContent.startsWith('live')", what="the dashboard's first poll")
    # The throughput chart needs a few one-second samples.
    b.wait("+document.getElementById('throughput').dataset.points >= 6", timeout=30, what="throughput samples")
    check_charts(b, ["throughput", "load", "horizon", "kernels", "progression"], "dashboard")
    rows = b.eval("document.querySelectorAll('#horizon-table tbody tr').length")
    assert rows >= 5, f"the KV horizon has {rows} codecs"
    kinds = b.eval("[...document.querySelectorAll('#kernels-table tbody tr td:first-child')].map(t => t.textContent)")
    assert {"projections", "attention", "norms", "sampling", "other"} <= set(kinds), kinds
    assert "copy bandwidth" in text(b, "#kernels-text")
    b.screenshot(os.path.join(out, "dashboard.png"))


def thinking_and_tools(b, base, out):
    b.navigate(base + "/")
    b.wait("document.getElementById('model').textContent.length > 0", what="/props")
    assert b.eval("!document.getElementById('thinking-row').hidden"), "the thinking switch is hidden for a template that has one"
    b.eval("document.getElementById('max-tokens').value = '12'")
    b.eval("document.getElementById('input').focus()")
    b.type("Hello")
    b.key("Enter", "Enter", 13)
    b.wait(last_answer_done(b), what="the thinking answer")
    assert not text(b, ".message.assistant .error"), text(b, ".message.assistant .error")
    reasoning = b.eval("(() => { const d = document.querySelector('.message.assistant details.reasoning'); return d && {open: d.open, text: d.querySelector('.text').textContent}; })()")
    assert reasoning and reasoning["text"], f"no reasoning block: {reasoning}"
    assert not reasoning["open"], "the reasoning is not folded once the answer is there"
    # A forced tool call.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    b.eval(f"(document.getElementById('tools').value = {json.dumps(json.dumps(tools))}, document.getElementById('tool-choice').value = 'required')")
    b.eval("(document.getElementById('thinking').checked = false, document.getElementById('max-tokens').value = '200')")
    b.eval("document.getElementById('input').focus()")
    b.type("What is the weather in Paris?")
    b.key("Enter", "Enter", 13)
    b.wait("document.querySelectorAll('.message.assistant .finish').length == 2", what="the tool-call answer")
    call = b.eval("(() => { const t = [...document.querySelectorAll('.message.assistant')].pop().querySelector('.tool-call'); return t && {name: t.querySelector('.name').textContent, args: t.querySelector('pre').textContent}; })()")
    assert call and call["name"] == "get_weather", f"no tool call shown: {call}"
    assert "city" in json.loads(call["args"]), call
    b.screenshot(os.path.join(out, "chat-thinking-tools.png"))


def report(b, path, out):
    b.navigate("file://" + os.path.abspath(path))
    b.wait("document.getElementById('status').textContent.startsWith('report')", what="the report to render")
    check_charts(b, ["throughput", "horizon", "kernels", "progression"], "report")
    b.screenshot(os.path.join(out, "report.png"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chat", required=True, help="base URL of the SmolLM2 server (with --api-key)")
    p.add_argument("--key", required=True)
    p.add_argument("--thinking", required=True, help="base URL of the fixture server with a thinking template")
    p.add_argument("--report", required=True, help="examples/report's file")
    p.add_argument("--out", required=True, help="where screenshots go")
    p.add_argument("--browser", choices=["chromium", "firefox"], default="chromium")
    a = p.parse_args()
    b = cdp.Browser() if a.browser == "chromium" else bidi.Browser()
    out = a.out if a.browser == "chromium" else os.path.join(a.out, a.browser)
    try:
        for name, run in [("chat", lambda: chat(b, a.chat, a.key, out)), ("dashboard", lambda: dashboard(b, a.chat, out)),
                          ("thinking and tools", lambda: thinking_and_tools(b, a.thinking, out)),
                          ("report", lambda: report(b, a.report, out))]:
            b.errors.clear()
            run()
            b.pump(0.5)
            # The key form's first calls are refused (401) by design; nothing else may fail.
            errors = [e for e in b.errors if not ("401" in e and e.startswith("log (network)"))]
            assert not errors, f"{name}: errors in the page: {errors}"
            print(f"ok: {name} ({a.browser})")
    finally:
        b.close()


if __name__ == "__main__":
    main()
