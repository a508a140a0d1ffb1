"""The official `openai` Python client against a running `calla serve` (the demo checkpoint: random
weights, so the text is meaningless, but every structural promise of the API is checked)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import calla_bin

MODEL = "calla-demo"


def client(server, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", max_retries=0, timeout=60, **kw)


def test_models(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streamed(server):
    r = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        max_tokens=16,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    usage = r.usage
    assert usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def collect_stream(stream):
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    return chunks, text, reasoning


def test_chat_streamed_matches_non_streamed(server):
    c = client(server)
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=24,
        temperature=0.8,
        seed=11,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    plain = c.chat.completions.create(**request)
    stream = c.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks, text, reasoning = collect_stream(stream)
    assert len({ch.id for ch in chunks}) == 1, "one id for the whole stream"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:] if ch.choices)
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert text == (plain.choices[0].message.content or "")
    assert reasoning == (getattr(plain.choices[0].message, "reasoning_content", None) or "")


def test_completions(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 8
    by_ids = c.completions.create(model=MODEL, prompt=[[480, 146, 238], [428, 241]], max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [ch.index for ch in by_ids.choices] == [0, 1]
    assert by_ids.usage.prompt_tokens == 5
    streamed = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text


def test_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as empty:
        c.chat.completions.create(model=MODEL, messages=[])
    assert empty.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as too_long:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 5000}])
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    # still serving
    assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_api_key(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server, api_key="wrong").models.list()
    assert client(keyed_server, api_key="sk-calla-test").models.list().data[0].id == MODEL
    with urllib.request.urlopen(f"{keyed_server.base_url}/health", timeout=5) as r:
        assert r.status == 200


def test_client_disconnecting_mid_stream_stops_its_generation(server):
    c = client(server)
    before = server.metrics()
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Talk for a long time."}],
        max_tokens=3900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for _chunk in stream:
        seen += 1
        if seen == 5:
            break
    # another client's request completes while (and after) the first one goes away
    other = {}
    thread = threading.Thread(target=lambda: other.update(r=c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Short."}], max_tokens=8)))
    thread.start()
    stream.close()
    thread.join(timeout=60)
    assert other["r"].choices[0].finish_reason in ("stop", "length")
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        idle = m["calla:num_requests_running"] == 0 and m["calla:num_requests_waiting"] == 0
        if idle and m["calla:request_cancelled_total"] > before.get("calla:request_cancelled_total", 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    generated = m["calla:generation_tokens_total"] - before["calla:generation_tokens_total"]
    assert generated < 3900, f"{generated} tokens: the abandoned stream was generated to the end"
    time.sleep(0.3)
    assert server.metrics()["calla:generation_tokens_total"] == m["calla:generation_tokens_total"]


def test_32_concurrent_streams_each_get_their_own_tokens(server):
    c = client(server)

    def request(i):
        return dict(model=MODEL, messages=[{"role": "user", "content": f"Client number {i}."}],
                    max_tokens=24, temperature=1.0, seed=1000 + i)

    def run(i):
        stream = c.chat.completions.create(**request(i), stream=True, stream_options={"include_usage": True})
        chunks, text, reasoning = collect_stream(stream)
        return i, chunks, text, reasoning

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(run, range(32)))
    ids = set()
    for i, chunks, text, reasoning in results:
        stream_ids = {ch.id for ch in chunks}
        assert len(stream_ids) == 1
        ids |= stream_ids
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
        # the same request alone gives the same tokens: nothing crossed between streams
        alone = c.chat.completions.create(**request(i))
        assert text == (alone.choices[0].message.content or ""), i
        assert reasoning == (getattr(alone.choices[0].message, "reasoning_content", None) or ""), i
    assert len(ids) == 32


def test_terminal_chat(tmp_path):
    out = subprocess.run(
        [calla_bin(), "chat", "--max-tokens", "6", "--seed", "3"],
        input="Hello\n/reset\nAgain\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr
    assert "(conversation cleared)" in out.stdout
    assert out.stdout.count("[stopped: length]") + out.stdout.count("</think>") >= 2
