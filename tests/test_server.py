"""The completion server (book/server.md): the protocol, batching, backpressure, shutdown.

Every server here listens on 127.0.0.1 only, on a free port, and is stopped by its test.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import npformer as npf  # noqa: E402
from npformer.sampling import generate  # noqa: E402
from npformer.server import (  # noqa: E402
    Client,
    CompletionServer,
    Detokenizer,
    RequestError,
    load_run,
    parse_completion,
    serve_in_thread,
)
from npformer.serving import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BABY = ROOT / "book" / "data" / "gpt_baby.safetensors"
PROMPTS = ["def f(x):\n", "The ", "import ", "class A", "return ", "    if ", "# ", "for i"]


@pytest.fixture(scope="module")
def baby():
    model, tok, name = load_run(BABY)
    return model, tok


def _greedy(model, tok, prompt: str, n: int) -> str:
    ids = np.array([tok.encode(prompt)])
    return tok.decode(generate(model, ids, n, temperature=0)[0, ids.shape[1]:])


@pytest.fixture(scope="module")
def server(baby):
    model, tok = baby
    srv = CompletionServer(Engine(model, block_size=16, max_batch=8), tok,
                           context=model.config.block_size, name="gpt_baby", max_queue=32)
    with serve_in_thread(srv) as port:
        yield srv, Client(port)


def test_parse_completion_names_each_fault(baby):
    _, tok = baby

    def fault(body) -> str:
        with pytest.raises(RequestError) as exc:
            parse_completion(body if isinstance(body, bytes) else json.dumps(body).encode(),
                             tok, 64)
        assert exc.value.status == 400
        return str(exc.value)

    assert fault(b"{nope").startswith("body: expected a JSON object, got invalid JSON")
    assert fault([1]) == "body: expected a JSON object, got list"
    assert fault({}) == "prompt: expected a string, got nothing"
    assert fault({"prompt": ""}).startswith("prompt: expected a non-empty string")
    assert fault({"prompt": "a", "n": 2}).startswith("n: expected one of the fields")
    assert fault({"prompt": "a", "max_tokens": 0}) == \
        "max_tokens: expected an integer >= 1, got 0"
    assert fault({"prompt": "a", "max_tokens": True}).startswith("max_tokens: expected")
    assert fault({"prompt": "a", "temperature": -1}).startswith("temperature: expected")
    assert fault({"prompt": "a", "stop": []}).startswith("stop: expected")
    assert fault({"prompt": "a", "stream": "yes"}).startswith("stream: expected true")
    assert "U+4E2D" in fault({"prompt": "a\u4e2d"})  # the character the model cannot read
    assert fault({"prompt": "x" * 60, "max_tokens": 5}) == (
        "max_tokens: expected at most 4 (the model's context is 64 tokens and the prompt "
        "takes 60), got 5")
    r = parse_completion(b'{"prompt": "ab", "stop": "\\n", "temperature": 0, "seed": 3}',
                         tok, 64)
    assert (r.ids, r.max_tokens, r.temperature, r.stop, r.seed, r.stream) == \
        (tok.encode("ab"), 16, 0.0, ("\n",), 3, False)


def _answer(text: str, stop) -> str:
    """The text up to the first stop string to occur (generation ends there)."""
    for m in range(1, len(text) + 1):
        found = [i for i in map(text[:m].find, stop) if i >= 0]
        if found:
            return text[:min(found)]
    return text


def test_streamed_pieces_join_into_the_answer_ended_by_the_first_stop_string():
    tok = npf.CharTokenizer("ab\ufffd")
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("ab"), size=rng.integers(1, 12)))
        stop = tuple({"".join(rng.choice(list("ab"), size=rng.integers(1, 4)))
                      for _ in range(rng.integers(1, 4))})
        d, out, hit = Detokenizer(tok, stop), "", False
        for t in tok.encode(text):
            piece, hit = d.push(t)
            out += piece
            if hit:
                break
        out += "" if hit else d.flush()
        assert out == _answer(text, stop), (text, stop)
    d = Detokenizer(tok)  # an unfinished character (U+FFFD) is held back until flushed
    assert d.push(0) == ("a", False) and d.push(2) == ("", False) and d.flush() == "\ufffd"


def test_routes_answer_with_openai_shapes_and_clear_errors(server):
    _, c = server
    assert c.request("GET", "/health")[:3:2] == (200, {"status": "ok", "accepted": 0,
                                                       "max_queue": 32})
    status, _, body = c.request("GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "gpt_baby"
    status, _, body = c.request("GET", "/v2/nothing")
    assert status == 404 and "path: expected /v1/completions" in body["error"]["message"]
    status, headers, body = c.request("GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert body["error"]["message"] == "method: expected POST for /v1/completions, got GET"
    status, _, body = c.request("POST", "/v1/completions", b"{")
    assert status == 400 and body["error"]["message"].startswith("body: expected a JSON")
    status, _, body = c.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 99})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, _, body = c.request("POST", "/v1/completions", b" " * 70_000)
    assert status == 413 and "at most 65536 bytes" in body["error"]["message"]
    r = c.complete("def f(x):\n", max_tokens=5, temperature=0)
    assert r["object"] == "text_completion" and r["model"] == "gpt_baby"
    assert r["id"].startswith("cmpl-") and isinstance(r["created"], int)
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["index"] == 0
    assert r["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_concurrent_greedy_completions_equal_generate_alone(server, baby):
    srv, c = server
    model, tok = baby
    n = 24
    results: dict = {}

    def ask(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:  # half of the clients stream
            chunks = list(c.stream(prompt, max_tokens=n, temperature=0))
            results[i] = ("".join(ch["choices"][0]["text"] for ch in chunks),
                          chunks[-1]["choices"][0]["finish_reason"], len(chunks))
        else:
            r = c.complete(prompt, max_tokens=n, temperature=0)
            results[i] = (r["choices"][0]["text"], r["choices"][0]["finish_reason"], 1)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(16))
    for i, (text, reason, _) in results.items():
        assert text == _greedy(model, tok, PROMPTS[i % len(PROMPTS)], n), i
        assert reason == "length"
    assert all(results[i][2] > 1 for i in range(1, 16, 2))  # streamed in pieces
    assert srv.worker.accepted == 0
    assert len(srv.worker.engine.cache.allocator.free) == \
        srv.worker.engine.cache.allocator.num_blocks  # every block given back


def test_stop_strings_cancel_the_engine_request_and_seeds_repeat(server, baby):
    _, c = server
    model, tok = baby
    full = _greedy(model, tok, "def f(x):\n", 40)
    stop = full[12:14]
    want = full[:full.find(stop)]
    r = c.complete("def f(x):\n", max_tokens=40, temperature=0, stop=[stop, "\u00df\u00df"])
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (want, "stop")
    chunks = list(c.stream("def f(x):\n", max_tokens=40, temperature=0, stop=stop))
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 40  # stopped early, not run to max_tokens
    a, b = (c.complete("The ", max_tokens=20, temperature=1.0, top_k=10, seed=7)
            for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    srv, _ = server
    deadline = time.time() + 2
    while srv.worker.accepted and time.time() < deadline:  # the cancels are handled
        time.sleep(0.005)
    alloc = srv.worker.engine.cache.allocator
    assert srv.worker.accepted == 0 and len(alloc.free) == alloc.num_blocks


class _Gated:
    """An engine whose steps wait for a gate: requests stay accepted until it opens."""

    def __init__(self, engine, delay: float = 0.0):
        self.engine, self.gate, self.delay, self.cancelled = engine, threading.Event(), delay, []

    def submit(self, *a, **kw):
        return self.engine.submit(*a, **kw)

    def step(self):
        self.gate.wait()
        time.sleep(self.delay)
        return self.engine.step()

    def cancel(self, rid):
        self.cancelled.append(rid)
        self.engine.cancel(rid)

    @property
    def busy(self):
        return self.engine.busy


def test_a_full_queue_answers_503_with_retry_after_at_once(baby):
    model, tok = baby
    engine = _Gated(Engine(model, max_batch=4))
    srv = CompletionServer(engine, tok, context=64, max_queue=2)
    with serve_in_thread(srv) as port:
        c = Client(port)
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(
            c.complete("The ", max_tokens=3, temperature=0))) for _ in range(2)]
        for t in threads:
            t.start()
        while srv.worker.accepted < 2:
            time.sleep(0.005)
        t0 = time.perf_counter()
        status, headers, body = c.request("POST", "/v1/completions", {"prompt": "a"})
        assert time.perf_counter() - t0 < 0.5
        assert status == 503 and headers["retry-after"] == "1"
        assert body["error"]["message"] == "2 requests are waiting or running"
        engine.gate.set()
        for t in threads:
            t.join()
    assert len(answers) == 2


def test_a_client_that_goes_away_cancels_its_request(baby):
    model, tok = baby
    engine = _Gated(Engine(model, max_batch=4), delay=0.01)
    engine.gate.set()
    srv = CompletionServer(engine, tok, context=64)
    with serve_in_thread(srv) as port:
        for stream in (True, False):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/completions", json.dumps(
                {"prompt": "The ", "max_tokens": 50, "stream": stream}).encode())
            if stream:
                resp = conn.getresponse()
                assert resp.readline().startswith(b"data: ")  # one token arrived
            else:
                time.sleep(0.05)
            conn.sock.shutdown(2)
            conn.close()
            deadline = time.time() + 5
            while srv.worker.accepted and time.time() < deadline:
                time.sleep(0.01)
            assert srv.worker.accepted == 0
        assert len(engine.cancelled) == 2  # well before its 50 tokens (0.5 s)
        alloc = engine.engine.cache.allocator
        assert len(alloc.free) == alloc.num_blocks


def test_sigterm_finishes_every_accepted_request_then_exits_0():
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "npformer", "serve", str(BABY), "--port", "0", "--max-batch",
         "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("npformer serve: http://127.0.0.1:"), line
        c = Client(int(line.rsplit(":", 1)[1]))
        results: dict = {}

        def ask(i: int) -> None:
            if i % 2:
                chunks = list(c.stream(PROMPTS[i], max_tokens=40, temperature=0))
                results[i] = "".join(ch["choices"][0]["text"] for ch in chunks)
            else:
                results[i] = c.complete(PROMPTS[i], max_tokens=40,
                                        temperature=0)["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        while c.request("GET", "/health")[2]["accepted"] < 6:
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)  # one request runs, five wait (max batch 1)
        time.sleep(0.05)
        try:  # a new request is refused: 503 while the socket is open, then no connection
            assert c.request("POST", "/v1/completions", {"prompt": "a"})[0] == 503
        except ConnectionError:
            pass
        for t in threads:
            t.join()
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    model, tok, _ = load_run(BABY)
    assert results == {i: _greedy(model, tok, PROMPTS[i], 40) for i in range(6)}


def test_a_train_run_folder_is_served_and_a_missing_run_is_named(tmp_path):
    from npformer.cli import main

    (tmp_path / "corpus.txt").write_text("abcabd abcabd\n" * 40)
    assert main(["train", "gpt", "--data", str(tmp_path / "corpus.txt"), "--out",
                 str(tmp_path / "run"), "--steps", "2", "--quiet", "--n-layer", "1",
                 "--n-head", "2", "--d-model", "16", "--block-size", "16",
                 "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1"]) == 0
    model, tok, name = load_run(tmp_path / "run")
    assert name == "run" and tok.decode(tok.encode("abd \n")) == "abd \n"
    srv = CompletionServer(Engine(model, max_batch=2), tok, context=16, name=name)
    with serve_in_thread(srv) as port:
        r = Client(port).complete("ab", max_tokens=6, temperature=0)
    assert r["choices"][0]["text"] == _greedy(model, tok, "ab", 6)
    with pytest.raises(ValueError, match="run: expected a run folder holding "
                                         "ckpt.safetensors, or a checkpoint file, got "):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="which does not exist"):
        load_run(tmp_path / "nothing.safetensors")
