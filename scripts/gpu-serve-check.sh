#!/usr/bin/env bash
# `calla serve --device cuda` on a committed fixture, on the GPU machine (binaries from
# scripts/gpu-build.sh): a plain chat request, a structured-output request (json_schema, enforced by
# constrained decoding) and an Anthropic Messages request; prints one line each and exits non-zero
# on any failure.   usage: scripts/gpu-serve-check.sh [FIXTURE]   (default qwen35moe-mlx4)
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
model=tests/fixtures/models/${1:-qwen35moe-mlx4}
port=18431
"$BIN_DIR/calla" serve --model "$model" --device cuda --port $port > "$OUT_DIR/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
python3 - "$port" "$(basename "$model")" <<'PY'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
name = sys.argv[2]
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
ok = True
r = post("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16})
print("chat:", r["choices"][0]["finish_reason"], r["usage"])
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
r = post("/v1/chat/completions", {"model": name, "max_tokens": 64, "messages": [{"role": "user", "content": "A person"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
text = r["choices"][0]["message"]["content"]
try:
    v = json.loads(text)
    good = set(v) == {"name", "age"} and isinstance(v["name"], str) and isinstance(v["age"], int)
except Exception:
    good = False
print("json_schema:", "PASS" if good else "FAIL", repr(text))
ok &= good
r = post("/v1/messages", {"model": name, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]})
good = r["type"] == "message" and r["content"] and r["stop_reason"] in ("end_turn", "max_tokens")
print("anthropic messages:", "PASS" if good else "FAIL", r["stop_reason"], r["usage"])
ok &= good
sys.exit(0 if ok else 1)
PY
