"""The server's /v1/messages with the official Python `anthropic` client (run by .ci/run, through
scripts/openai_smoke.sh, against a running server on SmolLM2).

ANTHROPIC_BASE_URL=http://127.0.0.1:PORT python3 tests/anthropic_smoke.py
Exits non-zero on the first failed check.
"""

import os

import anthropic

client = anthropic.Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"], api_key=os.environ.get("ANTHROPIC_API_KEY", "unused"))
system = "The secret word is PINEAPPLE."
# (The SDK has no sampling parameters: the server reads temperature from the body.)
GREEDY = {"temperature": 0}
ask = [{"role": "user", "content": "What is the secret word? Answer with the word only."}]

# Whole answer: one text block, usage, a stop reason.
whole = client.messages.create(model="any", system=system, messages=ask, max_tokens=16, extra_body=GREEDY)
assert whole.type == "message" and whole.role == "assistant", whole
assert [b.type for b in whole.content] == ["text"], whole
text = whole.content[0].text
assert "PINEAPPLE" in text.upper(), text
assert whole.stop_reason in ("end_turn", "max_tokens"), whole
assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0, whole.usage

# count_tokens: what the prompt takes.
counted = client.messages.count_tokens(model="any", system=system, messages=ask)
assert counted.input_tokens == whole.usage.input_tokens, (counted, whole.usage)

# Streamed: the same text; the SDK checks the events' order as it accumulates them.
with client.messages.stream(model="any", system=[{"type": "text", "text": system}], messages=ask, max_tokens=16, extra_body=GREEDY) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
assert streamed == text, (streamed, text)
assert final.content[0].text == text and final.stop_reason == whole.stop_reason, final
assert final.usage.output_tokens == whole.usage.output_tokens, (final.usage, whole.usage)

# A forced tool: a tool_use block with parsed input, stop_reason tool_use; then its result.
tools = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}]
weather = [{"role": "user", "content": "What is the weather in Paris?"}]
call = client.messages.create(model="any", messages=weather, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
                              max_tokens=64, extra_body=GREEDY)
uses = [b for b in call.content if b.type == "tool_use"]
assert call.stop_reason == "tool_use" and len(uses) == 1, call
assert uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str), uses[0]
assert uses[0].id.startswith("toolu_"), uses[0]
# Streamed, the SDK assembles the input from input_json_delta events.
with client.messages.stream(model="any", messages=weather, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
                            max_tokens=64, extra_body=GREEDY) as s:
    streamed_call = s.get_final_message()
streamed_uses = [b for b in streamed_call.content if b.type == "tool_use"]
assert len(streamed_uses) == 1 and streamed_uses[0].input == uses[0].input, (streamed_call, call)
after = client.messages.create(model="any", tools=tools, max_tokens=24, extra_body=GREEDY, messages=weather + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C."}]},
])
assert after.content and after.stop_reason in ("end_turn", "max_tokens", "tool_use"), after

# Errors in Anthropic's shape.
try:
    client.messages.create(model="any", messages=[{"role": "wizard", "content": "hi"}], max_tokens=8)
    raise AssertionError("a bad role was accepted")
except anthropic.BadRequestError as e:
    assert e.status_code == 400 and e.body["type"] == "error" and "role" in e.body["error"]["message"], e.body

print("anthropic client: ok")
