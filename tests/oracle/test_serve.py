"""`memra serve` end to end on the embedded default model (CPU), driven by real clients: the `openai` package
(chat and completions, streaming and not), raw HTTP for the byte-level SSE contract and disconnects, and
`prometheus_client` for /metrics. Checks that the server's greedy text equals `memra run`'s (batch and chunk
invariance across the CLI and the server), that a response's seed reproduces it, the SSE chunk order
(role first, one finish_reason per choice, the usage chunk, [DONE]), log-probabilities, the error envelope and
status of every refusal (400, 401, 404, 429, 503), 256 concurrent streams, that a client that disconnects
(streaming or not) has its request cancelled and its pages returned, and a clean shutdown on SIGINT / SIGTERM
with every page back. /apply-template is compared with transformers' apply_chat_template."""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from oracle_util import memra_exe

openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

MODEL_NAME = "default"
DEVICE = os.environ.get("MEMRA_SERVE_DEVICE", "cpu")  # scripts/gpu.sh runs the suite on cuda
PROMPT = "A list is a mutable sequence"


class Server:
    """A `memra serve` process on a free port; stop() sends a signal and returns (exit code, stderr)."""

    def __init__(self, *flags):
        self.proc = subprocess.Popen([memra_exe(), "serve", "--port", "0", "--device", DEVICE, "-t", "2", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log = []
        deadline = time.time() + 120
        self.port = None
        while self.port is None:
            line = self.proc.stderr.readline()
            assert line or self.proc.poll() is None, f"memra serve exited: {''.join(self.log)}"
            self.log.append(line)
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
            assert time.time() < deadline, "memra serve did not start"
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                                    timeout=120)

    def _read_rest(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def request(self, method, path, body=None, headers=None, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = json.dumps(body) if isinstance(body, (dict, list)) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read().decode()
        conn.close()
        return resp.status, payload

    def metrics(self):
        status, text = self.request("GET", "/metrics")
        assert status == 200
        values = {}
        for family in prometheus_parser.text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                values[key] = s.value
        return values

    def stop(self, sig=signal.SIGINT):
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=60)
        self._drain.join(timeout=10)
        return rc, "".join(self.log)


@pytest.fixture(scope="module")
def server():
    s = Server("-c", "8192", "--max-num-seqs", "16")
    yield s
    rc, log = s.stop()
    assert rc == 0, log
    m = re.search(r"stopped; (\d+) of (\d+) KV pages free", log)
    assert m and m.group(1) == m.group(2), log


def wait_for(predicate, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def sse_events(raw):
    """The data payloads of a server-sent-event body, checking the framing (each event "data: ...\\n\\n")."""
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):  # a comment (ping)
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: "):])
    assert raw.endswith("data: [DONE]\n\n")
    return events


def test_health_models_tokenize(server):
    assert server.request("GET", "/health") == (200, '{"status":"ok"}')
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    status, body = server.request("POST", "/tokenize", {"prompt": PROMPT})
    assert status == 200
    ids = json.loads(body)["tokens"]
    assert json.loads(body)["count"] == len(ids) and ids[0] == 0  # BOS first (add_bos_token)
    status, body = server.request("POST", "/detokenize", {"tokens": ids[1:]})
    assert status == 200 and json.loads(body)["prompt"] == PROMPT


def test_greedy_completion_equals_memra_run(server):
    run = subprocess.run([memra_exe(), "run", "--device", DEVICE, "-p", PROMPT, "-n", "32", "--temp", "0",
                          "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    resp = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert resp.choices[0].text == run.stdout[:-1]  # run ends its output with a newline
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 32
    assert resp.usage.prompt_tokens == resp.usage.total_tokens - 32


def test_streaming_completion_equals_whole_and_follows_the_sse_contract(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 7,
            "stream": True, "stream_options": {"include_usage": True}}
    status, raw = server.request("POST", "/v1/completions", body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    whole = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0.8,
                                             seed=7)
    assert whole.choices[0].text == text


def test_a_response_seed_reproduces_it(server):
    first = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=1.0)
    seed = first.model_extra["seed"]
    again = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=1.0,
                                             seed=seed)
    assert again.choices[0].text == first.choices[0].text
    # n choices: choice i is the random stream (seed, i), whatever else the request asks for.
    many = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                            seed=seed, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    short = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                             seed=seed)
    assert many.choices[0].text == short.choices[0].text
    assert len({c.text for c in many.choices}) > 1


def test_chat_reasoning_streams_like_the_whole_answer(server):
    messages = [{"role": "system", "content": "You answer questions about Python."},
                {"role": "user", "content": "What is a list?"}]
    whole = server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30,
                                                  temperature=0)
    msg = whole.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content") or ""
    assert msg.role == "assistant" and (reasoning or msg.content)
    stream = server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30,
                                                   temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                                 for c in chunks)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed_reasoning == reasoning
    assert streamed_content == (msg.content or "")
    assert whole.usage.completion_tokens == 30 or whole.choices[0].finish_reason == "stop"


def test_apply_template_equals_transformers(server):
    transformers = pytest.importorskip("transformers")
    model_dir = Path(os.environ.get("MEMRA_SOURCE_DIR", Path(__file__).resolve().parents[2])) / "models" / "default"
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
                 "tool_calls": [{"id": "call_0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
                {"role": "user", "content": "Thanks!"}]
    status, body = server.request("POST", "/apply-template", {"messages": messages, "tools": tools})
    assert status == 200, body
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = tok.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert json.loads(body)["prompt"] == want
    status, body = server.request("POST", "/tokenize", {"messages": messages, "tools": tools})
    assert status == 200
    assert json.loads(body)["tokens"] == tok.encode(want, add_special_tokens=False)


def test_logprobs(server):
    chat = server.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the most likely one
    comp = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == comp.choices[0].text


def test_stop_strings(server):
    base = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    text = base.choices[0].text
    stop = text[10:13]
    cut = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                           stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, needle", [
    ({"model": MODEL_NAME, "prompt": PROMPT, "temperature": "hot"}, 400, "temperature: expected a number"),
    ({"model": "gpt-4", "prompt": PROMPT}, 404, "does not exist"),
    ({"model": MODEL_NAME, "prompt": "word " * 9000}, 400, "maximum context length is 4096"),
    ({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"5": 101}},
     400, 'logit_bias["5"]: expected a number in [-100, 100], found 101'),
    ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"5": "up"}},
     400, 'logit_bias["5"]: expected a number in [-100, 100], found a string'),
    ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"five": 1}}, 400, 'key "five" is not a decimal token id'),
    ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"1024": 1}},
     400, "logit_bias: token id 1024 is outside the vocabulary of 1024"),
    ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": [5]}, 400, "logit_bias: expected an object"),
    ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(1024)} | {"0000": 1}},
     400, "logit_bias: expected at most 1024 entries, found 1025"),
    ({"model": MODEL_NAME, "prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL_NAME}, 400, "prompt: required"),
    ("{not json", 400, "not valid JSON"),
])
def test_refusals_use_the_openai_envelope(server, body, status, needle):
    got, payload = server.request("POST", "/v1/completions", body)
    assert got == status, payload
    err = json.loads(payload)["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    if isinstance(body, dict) and "logit_bias" in body:
        assert err["param"] == "logit_bias"


def test_logit_bias_forces_and_bans_tokens(server):
    """OpenAI's logit_bias through the openai client: +100 on a token id (picked with /tokenize) makes greedy
    decoding emit it at every step, with the log-probabilities still the raw logits' (the unbiased greedy token
    stays the top alternative); -100 on the greedy token makes greedy decoding pick another one."""
    status, body = server.request("POST", "/tokenize", {"prompt": " list"})
    assert status == 200
    forced = json.loads(body)["tokens"][-1]
    status, body = server.request("POST", "/detokenize", {"tokens": [forced] * 4})
    assert status == 200
    want = json.loads(body)["prompt"]
    plain = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                             logprobs=1, extra_body={"ignore_eos": True})
    assert plain.choices[0].text != want
    comp = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                            logprobs=1, logit_bias={str(forced): 100},
                                            extra_body={"ignore_eos": True})
    assert comp.choices[0].text == want
    lp = comp.choices[0].logprobs
    assert list(lp.top_logprobs[0]) == [plain.choices[0].logprobs.tokens[0]]  # raw logits: the greedy token on top
    assert lp.token_logprobs[0] < plain.choices[0].logprobs.token_logprobs[0]
    # Sampled (T = 0.8, seeded) and in chat, the forced token too.
    chat = server.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, temperature=0.8, seed=5,
                                                 logit_bias={str(forced): 100})
    status, body = server.request("POST", "/detokenize", {"tokens": [forced] * 3})
    message = chat.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    assert reasoning + (message.content or "") == json.loads(body)["prompt"]
    # A ban: the unbiased greedy first token, banned, is not the first token any more.
    status, body = server.request("POST", "/tokenize", {"prompt": plain.choices[0].logprobs.tokens[0]})
    ids = json.loads(body)["tokens"][1:]  # BOS first
    assert len(ids) == 1
    banned = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                              logprobs=1, logit_bias={str(ids[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    # null and {} are no bias.
    for none in (None, {}):
        again = server.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                                 extra_body={"ignore_eos": True, "logit_bias": none})
        assert again.choices[0].text == plain.choices[0].text


def test_unknown_route_and_chat_errors(server):
    status, payload = server.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(payload)["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=4)


def test_many_concurrent_streams(server):
    """256 streams at once, each served (the HTTP pool holds them), each greedy answer equal to its solo run."""
    prompts = [f"{PROMPT} number {i}" for i in range(8)]
    solo = {p: server.client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0)
            .choices[0].text for p in prompts}

    def stream(i):
        body = {"model": MODEL_NAME, "prompt": prompts[i % 8], "max_tokens": 6, "temperature": 0, "stream": True}
        status, raw = server.request("POST", "/v1/completions", body, timeout=600)
        assert status == 200
        events = sse_events(raw)
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    with ThreadPoolExecutor(max_workers=256) as pool:
        texts = list(pool.map(stream, range(256)))
    for i, t in enumerate(texts):
        assert t == solo[prompts[i % 8]]


def test_the_listening_socket_queues_bursts_and_owns_its_port(server):
    """The backlog holds a burst of clients (httplib's own is 5: 256 clients at once overflowed it and some were
    reset), and a second server on the same port is refused instead of sharing it (no SO_REUSEPORT)."""
    if shutil.which("ss"):  # iproute2: scripts/setup.sh installs it; the GPU host may lack it
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        listing = subprocess.run(["ss", "-Hltn", f"sport = :{server.port}"], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert listing[0] == "LISTEN" and int(listing[2]) == min(4096, somaxconn), listing
    second = subprocess.run([memra_exe(), "serve", "--port", str(server.port), "--device", DEVICE, "-c", "8192"],
                            capture_output=True, text=True, timeout=120)
    assert second.returncode != 0
    assert f"cannot listen on 127.0.0.1:{server.port}" in second.stderr, second.stderr


def cancelled(server):
    return server.metrics().get("memra:request_success_total|finished_reason=cancelled", 0)


def idle(server):
    m = server.metrics()
    return m["memra:num_requests_running"] == 0 and m["memra:kv_cache_usage_perc"] == 0


def test_a_client_that_disconnects_is_cancelled_and_its_pages_return(server):
    before = cancelled(server)
    # Streaming: read the first event, then hang up.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4000,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline().startswith(b"")
    conn.sock.close()
    conn.close()
    assert wait_for(lambda: cancelled(server) == before + 1), server.metrics()
    # Not streaming: hang up while the answer is being generated.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4000,
                                                        "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.sock.close()
    conn.close()
    assert wait_for(lambda: cancelled(server) == before + 2), server.metrics()
    assert wait_for(lambda: idle(server)), server.metrics()


def test_the_prefix_cache_reuses_a_prompt_and_changes_nothing(server):
    """A prompt sent again takes its whole 64-token blocks from the prefix cache (the hit counters grow by them)
    and the answer, with its log-probabilities, is byte-identical; a server without the cache answers the same."""
    prompt = " ".join(f"{PROMPT} {i}." for i in range(40))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    status, first = server.request("POST", "/v1/completions", body)
    assert status == 200
    before = server.metrics()
    status, again = server.request("POST", "/v1/completions", body)
    assert status == 200
    after = server.metrics()
    n_prompt = json.loads(first)["usage"]["prompt_tokens"]
    assert after["memra:prefix_cache_queries_total"] - before["memra:prefix_cache_queries_total"] == n_prompt
    assert after["memra:prefix_cache_hits_total"] - before["memra:prefix_cache_hits_total"] == (n_prompt - 1) // 64 * 64
    strip = lambda raw: {k: v for k, v in json.loads(raw).items() if k not in ("id", "created", "seed")}
    assert strip(again) == strip(first)
    cold = Server("-c", "8192", "--no-enable-prefix-caching")
    try:
        status, fresh = cold.request("POST", "/v1/completions", body)
        assert status == 200 and strip(fresh) == strip(first)
        cold.request("POST", "/v1/completions", body)
        assert cold.metrics()["memra:prefix_cache_hits_total"] == 0
    finally:
        cold.stop()


def test_speculation_changes_nothing_but_the_speed(server):
    """A server drafting with the MTP layers (--spec-draft 3) answers byte for byte as the module's server, greedy
    and seeded sampling, with log-probabilities; it reports the drafts it verified and accepted."""
    bodies = [{"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1, "seed": 1},
              {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 24, "temperature": 0.8, "seed": 5, "n": 2}]
    strip = lambda raw: {k: v for k, v in json.loads(raw).items() if k not in ("id", "created")}
    spec = Server("-c", "8192", "--spec-draft", "3")
    try:
        for body in bodies:
            want = server.request("POST", "/v1/completions", body)
            got = spec.request("POST", "/v1/completions", body)
            assert got[0] == want[0] == 200
            assert strip(got[1]) == strip(want[1])
        m = spec.metrics()
        assert m["memra:spec_decode_num_draft_tokens_total"] > 0
        assert m["memra:spec_decode_num_accepted_tokens_total"] > 0
        assert server.metrics()["memra:spec_decode_num_drafts_total"] == 0
    finally:
        rc, log = spec.stop()
    assert rc == 0 and "speculation 3 MTP drafts per decode step" in log, log


def test_a_kv_memory_budget_sizes_the_cache():
    """--kv-cache-memory sizes the KV cache in bytes (the startup line reports tokens and GiB within it); it
    excludes -c, and a budget too small for the sliding pool is refused with the sizes."""
    # Four sequences of 512-row steps: a sliding pool small enough for the budget on any device's defaults.
    s = Server("--kv-cache-memory", "48MiB", "--max-num-seqs", "4", "--max-num-batched-tokens", "512")
    try:
        line = next(l for l in s.log if "KV cache:" in l)
        m = re.search(r"KV cache: (\d+) tokens \(bf16 K, bf16 V, ([0-9.]+) MiB\)", line)
        assert m and int(m.group(1)) > 0 and 40 < float(m.group(2)) <= 48, line
        assert s.request("GET", "/health")[0] == 200
    finally:
        s.stop()
    both = subprocess.run([memra_exe(), "serve", "-c", "100", "--kv-cache-memory", "1MiB"], capture_output=True,
                          text=True, timeout=60)
    assert both.returncode != 0 and "excludes" in both.stderr, both.stderr
    small = subprocess.run([memra_exe(), "serve", "--port", "0", "--kv-cache-memory", "1KiB"], capture_output=True,
                           text=True, timeout=120)
    assert small.returncode != 0 and "--kv-cache-memory: KV budget of 1024 bytes" in small.stderr, small.stderr


def test_metrics_follow_the_vllm_names(server):
    m = server.metrics()
    for name in ["memra:num_requests_running", "memra:num_requests_waiting", "memra:kv_cache_usage_perc",
                 "memra:prompt_tokens_total", "memra:generation_tokens_total",
                 "memra:time_to_first_token_seconds_count", "memra:inter_token_latency_seconds_count",
                 "memra:e2e_request_latency_seconds_count", "memra:request_queue_time_seconds_count"]:
        assert name in m, name
    assert m["memra:generation_tokens_total"] > 0


def test_api_key_queue_limits_and_shutdown():
    s = Server("--api-key", "sekret", "--max-num-seqs", "1", "--max-queue", "1", "--queue-timeout", "0.5",
               "-c", "8192")
    try:
        auth = {"Authorization": "Bearer sekret"}
        status, payload = s.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 401 and json.loads(payload)["error"]["code"] == "invalid_api_key"
        assert s.request("GET", "/health")[0] == 200  # not behind the key
        long_body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        # One request runs, one waits; a third finds the queue full (429); the waiting one times out (503).
        first = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        first.request("POST", "/v1/completions", json.dumps(long_body), {**auth, "Content-Type": "application/json"})
        first_resp = first.getresponse()
        assert first_resp.status == 200
        results = {}

        def waiting():
            results["second"] = s.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers=auth)

        t = threading.Thread(target=waiting)
        t.start()
        assert wait_for(lambda: s.metrics()["memra:num_requests_waiting"] == 1)
        status, payload = s.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers=auth)
        assert status == 429 and json.loads(payload)["error"]["code"] == "queue_full"
        t.join()
        status, payload = results["second"]
        assert status == 503 and json.loads(payload)["error"]["code"] == "queue_timeout"
        # SIGTERM with the first stream in flight: it ends with an error event and [DONE]; every page returns.
        rc, log = s.stop(signal.SIGTERM)
        rest = first_resp.read().decode()
        first.close()
        assert "shutting down" in rest and rest.endswith("data: [DONE]\n\n"), rest[-300:]
        assert rc == 0, log
        m = re.search(r"stopped; (\d+) of (\d+) KV pages free", log)
        assert m and m.group(1) == m.group(2), log
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_memra_chat_answers_as_the_server_does(server):
    """`memra chat` (the same template, scheduler and parser, in the terminal) prints the server's answer for the
    same conversation: reasoning between <think> tags when stdout is a pipe, then the content."""
    question = "What is a list?"
    proc = subprocess.run([memra_exe(), "chat", "--device", DEVICE, "-n", "24", "--temp", "0"],
                          input=f"{question}\n/exit\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    resp = server.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                                                 max_tokens=24, temperature=0)
    msg = resp.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content") or ""
    want = (f"<think>\n{reasoning}\n</think>\n" if reasoning else "") + (msg.content or "") + "\n"
    assert proc.stdout == want
