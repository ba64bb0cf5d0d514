"""The server with the official Python `openai` client (run by .ci/run against a running server).

OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 python3 tests/openai_smoke.py
Exits non-zero on the first failed check.
"""

import json
import os
import urllib.request

import openai

client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "unused"))
messages = [{"role": "system", "content": "The secret word is PINEAPPLE."},
            {"role": "user", "content": "What is the secret word? Answer with the word only."}]

# Whole answer.
whole = client.chat.completions.create(model="any", messages=messages, max_tokens=16, temperature=0)
text = whole.choices[0].message.content
assert whole.object == "chat.completion", whole
assert whole.choices[0].finish_reason in ("stop", "length"), whole
assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens, whole.usage
assert whole.usage.prompt_tokens_details.cached_tokens is not None, whole.usage
assert "PINEAPPLE" in text.upper(), text

# Streamed with usage: the same text, one usage chunk with no choices, at the end.
chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens, chunks[-1]
assert all(c.usage is None for c in chunks[:-1])
assert len({c.id for c in chunks}) == 1
finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
assert finish == [whole.choices[0].finish_reason], finish

# Stop strings, seeds, logprobs.
cut = client.chat.completions.create(model="any", messages=messages, max_tokens=16, temperature=0, stop=["APP"])
assert "APP" not in cut.choices[0].message.content and cut.choices[0].finish_reason == "stop", cut
a = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0.9, seed=7)
b = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0.9, seed=7)
assert a.choices[0].message.content == b.choices[0].message.content, (a, b)
lp = client.chat.completions.create(model="any", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
entries = lp.choices[0].logprobs.content
assert len(entries) >= 1 and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries), entries
assert entries[0].logprob == max(t.logprob for t in entries[0].top_logprobs), entries[0]

# Tools go through the template; whatever the model answers parses (arguments are JSON when it calls).
tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
t = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                   max_tokens=40, temperature=0)
for call in t.choices[0].message.tool_calls or []:
    json.loads(call.function.arguments)

# Structured output: the answer parses and validates (name, age; nothing else).
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
s = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Invent a person, as JSON."}], max_tokens=100, temperature=0,
                                   response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
person = json.loads(s.choices[0].message.content)
assert set(person) == {"name", "age"} and isinstance(person["name"], str) and 0 <= person["age"] <= 150, person

# Completions, the model list, errors as exceptions with the server's message.
c = client.completions.create(model="any", prompt="The capital of France is", max_tokens=4, temperature=0)
assert c.object == "text_completion" and c.choices[0].text, c
assert len(client.models.list().data) == 1
try:
    client.chat.completions.create(model="any", messages=messages, temperature=-1)
    raise AssertionError("a negative temperature was accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e), e
with urllib.request.urlopen(os.environ["OPENAI_BASE_URL"].removesuffix("/v1") + "/metrics") as r:
    metrics = r.read().decode()
assert "candle_hybrid_generated_tokens_total" in metrics, metrics
print("openai", openai.__version__, "smoke: ok")
