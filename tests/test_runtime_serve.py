"""The serving runtime: a real aiohttp server on a saved checkpoint answers completions as the
model's own greedy decoding does, batches requests of one prompt length, refuses what is too
long naming the field, reports Prometheus metrics, and serves a GLVQ-quantised model."""

from __future__ import annotations

import asyncio
import json
import os
import pstats
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import runtime_harness as harness
import torch
from aiohttp import web

from huorn import models
from huorn.api import training
from huorn.runtime import chat, checkpoint, continuous_batching, prefix_cache, serve
from huorn.runtime import config as run_config
from huorn.runtime.data import tokenizer
from huorn.runtime.prompt import MAX_PROMPTS

ARCHITECTURE = {"layers": 2, "width": 32, "heads": 2, "context": 64}


def _saved_model(root: Path, ascii_only: bool = False, **architecture: object) -> torch.nn.Module:
    """`ascii_only`: a model that writes ASCII, as a trained one writes text (an untrained one's
    bytes are seldom UTF-8, and a client sends back the text they decode to)."""
    spec = training.ModelSpec.model_validate({**ARCHITECTURE, **architecture})
    torch.manual_seed(0)
    model = models.build_model(run_config.build_model_config(spec))
    if ascii_only:
        with torch.no_grad():
            model.head.weight[128:] = 0
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.save_checkpoint(root, 1, model, optimizer, {"model": spec.to_wire()}, rank=0,
                               barrier=lambda: None)
    return model.eval()


def _config(tmp_path: Path, architecture: dict | None = None, **spec: object) -> serve.ServeConfig:
    return serve.ServeConfig.model_validate({
        "jobName": "chat", "host": "127.0.0.1", "port": 0, "runDir": str(tmp_path / "run"),
        "dataDir": str(tmp_path / "data"), "quantizeSteps": 5, "calibrationBatches": 2,
        "spec": {"virtualCluster": "x", "model": {"checkpoint": str(tmp_path / "ckpt"),
                                                   "architecture": {**ARCHITECTURE, **(architecture or {})}},
                 "serving": {"maxBatch": 8, "maxTokens": 48}, **spec}})


def _sse_events(text: str) -> list[dict]:
    """A server-sent-events body's JSON events, without the closing [DONE]."""
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e and e != "data: [DONE]"]


def _metric(text: str, name: str) -> float:
    """One sample's value from the Prometheus text of /metrics."""
    [value] = [float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0] == name]
    return value


async def _serving(cfg: serve.ServeConfig, client_work) -> object:
    model, report = serve.load_model(cfg)
    server = serve.Server(cfg, model)
    async with harness.serving_app(server.app(), handler_cancellation=True) as session:
        return await client_work(session, server, report)


def test_completions_equal_greedy_decoding_and_same_length_prompts_share_a_batch(tmp_path: Path) -> None:
    model = _saved_model(tmp_path / "ckpt")
    prompts = ["Q: What is 1 + 2?\nA:", "Q: What is 7 + 5?\nA:", "Q: Hi?\nA:"]

    async def work(session, server, report):
        async def ask(prompt: str) -> dict:
            body = {"temperature": 0, "prompt": prompt, "max_tokens": 6}
            async with session.post("/v1/completions", json=body) as r:
                assert r.status == 200
                return await r.json()

        answers = await asyncio.gather(*(ask(p) for p in prompts))
        too_long = {"temperature": 0, "prompt": "x" * 40, "max_tokens": 10}
        async with session.post("/v1/completions", json=too_long) as r:
            refused = (r.status, await r.json())
        async with session.get("/metrics") as r:
            metrics = await r.text()
        return answers, refused, metrics

    answers, refused, metrics = asyncio.run(_serving(_config(tmp_path), work))
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens = torch.tensor([list(prompt.encode())])
        expected = model.generate(tokens, 6)[0, tokens.shape[1]:].tolist()
        assert answer["text"] == bytes(expected).decode("utf-8", errors="replace") and answer["tokens"] == 6
    status, error = refused
    assert status == 400 and error["error"]["message"].startswith("max_tokens:")
    assert "spec.serving.maxTokens" in error["error"]["message"]
    assert 'huorn_serve_requests_total{outcome="ok"} 3.0' in metrics
    assert 'huorn_serve_requests_total{outcome="refused"} 1.0' in metrics
    assert "huorn_serve_generated_tokens_total 18.0" in metrics


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_batcher_admits_the_oldest_into_free_rows_or_only_into_an_empty_batch(
        tmp_path: Path, batching: str) -> None:
    """Prompts of any lengths share the running batch; `continuous` fills its free rows before
    each step, `static` waits for it to end."""
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path, serving={"maxBatch": 3, "maxTokens": 48, "batching": batching})

    async def check() -> list[list[int]]:
        model, _ = serve.load_model(cfg)
        server = serve.Server(cfg, model)
        assert server.running.cache is not None and server.running.cache.capacity == 3  # allocated whole
        # the first wants one token: its row ends at the first step
        server.queue = [serve.Request(list(range(n)), 1 if i == 0 else 4, 0.0, 0)
                        for i, n in enumerate((3, 5, 4, 6, 5))]
        first = server.admissions()
        server.running.admit(first)
        full = server.admissions()  # their rows are promised while their prompts are prefilled
        server.running.prefill()
        answered = server.running.step()
        assert [len(r.tokens) for r, _ in answered] == [3] and len(server.running) == 2
        third = server.admissions()
        return [[len(r.tokens) for r in taken] for taken in (first, full, third)]

    expected = [[3, 5, 4], [], [6]] if batching == "continuous" else [[3, 5, 4], [], []]
    assert asyncio.run(check()) == expected


def test_a_prefill_delay_holds_arrivals_until_they_have_waited_or_fill_the_free_rows(tmp_path: Path) -> None:
    """`prefillDelayFactor`: while answers are decoded, an arrival waits until the oldest arrival
    has waited factor × the last prefill's iteration, so that arrivals share a prefill; arrivals
    that fill every free row, or an empty batch, are not held."""
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path, serving={"maxBatch": 4, "maxTokens": 48, "prefillDelayFactor": 2.0})

    async def check() -> None:
        model, _ = serve.load_model(cfg)
        server = serve.Server(cfg, model)
        server.last_prefill_seconds = 0.5
        first = serve.Request([1, 2, 3], 8, 0.0, 0)
        server.queue = [first]
        assert server.admissions(now=first.arrived) == [first]  # an empty batch: at once
        server.running.admit([first])
        server.running.prefill()
        assert len(server.running) == 1  # decoding: three rows free
        arrived = time.monotonic()
        second = serve.Request([6], 8, 0.0, 0, arrived=arrived)
        server.queue = [second]
        assert server.admissions(now=arrived + 0.9) == []  # waited less than 2 × 0.5 s
        assert server.queue == [second]  # held, not dropped
        assert server.admissions(now=arrived + 1.1) == [second]
        server.running.admit([second])
        # two arrivals fill the two rows left: nothing is gained by holding them
        both = [serve.Request([7], 8, 0.0, 0, arrived=arrived) for _ in range(2)]
        server.queue = list(both)
        assert server.admissions(now=arrived) == both

    asyncio.run(check())


def test_the_decoding_loop_measures_its_prefill_iterations(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path, serving={"maxBatch": 4, "maxTokens": 48})

    async def check() -> float:
        model, _ = serve.load_model(cfg)
        server = serve.Server(cfg, model)
        server.queue = [serve.Request([1, 2, 3], 4, 0.0, 0)]
        await asyncio.to_thread(server.decode)
        return server.last_prefill_seconds

    assert asyncio.run(check()) > 0


def test_a_gpu_serves_in_bf16_and_the_batcher_carries_bf16_weights(tmp_path: Path) -> None:
    """The GPU path's dtype on CPU (CI has no GPU): its KV cache takes the weights' dtype, its
    logits are sampled in fp32, and its answers are the bf16 model's own greedy decoding."""
    assert serve.serving_dtype(torch.device("cuda")) is torch.bfloat16
    assert serve.serving_dtype(torch.device("cpu")) is torch.float32
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path)
    prompts = ["Q: What is 1 + 2?\nA:", "Q: Hi?\nA:"]

    async def work(session, server, report):
        async def ask(prompt: str) -> dict:
            body = {"temperature": 0, "prompt": prompt, "max_tokens": 5}
            async with session.post("/v1/completions", json=body) as r:
                assert r.status == 200
                return await r.json()

        return report, server.running.cache.keys[0].dtype, await asyncio.gather(*(ask(p) for p in prompts))

    model, report = serve.load_model(cfg)
    assert report["dtype"] == "float32" and next(model.parameters()).dtype is torch.float32
    bf16 = model.to(torch.bfloat16)

    async def serving() -> tuple:
        server = serve.Server(cfg, bf16)
        async with harness.serving_app(server.app(), handler_cancellation=True) as session:
            return await work(session, server, {})

    _, cache_dtype, answers = asyncio.run(serving())
    assert cache_dtype is torch.bfloat16
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens = torch.tensor([list(prompt.encode())])
        expected = bf16.generate(tokens, 5)[0, tokens.shape[1]:].tolist()
        assert answer["text"] == bytes(expected).decode("utf-8", errors="replace")


def test_decoding_records_no_autograd_graph(tmp_path: Path) -> None:
    """With one, each step's write into the batch's KV cache chained its graph onto the cache's,
    and every activation since the start stayed alive (a GPU replica ran out of memory in a
    minute). The server's model asks for no gradients, and the batch decodes without them even
    for a model that does."""
    trainable = _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path)
    loaded, _ = serve.load_model(cfg)
    assert not any(p.requires_grad for p in loaded.parameters())
    assert all(p.requires_grad for p in trainable.parameters())

    async def serving() -> tuple[bool, bool]:
        server = serve.Server(cfg, trainable)
        async with harness.serving_app(server.app(), handler_cancellation=True) as session:
            for prompt in ("Q: 1 + 1?\nA:", "Hello"):
                async with session.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}) as r:
                    assert r.status == 200
        cache = server.running.cache
        return (any(t.requires_grad or t.grad_fn is not None for t in cache.keys + cache.values),
                any(row.logits.requires_grad for row in server.running.rows))

    assert asyncio.run(serving()) == (False, False)


def test_a_glvq_model_is_quantised_at_load_and_answers(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path, quantization={"method": "glvq", "bits": 4, "groupSize": 8})

    async def work(session, server, report):
        async with session.post("/v1/completions", json={"prompt": "Q: 2 + 2?\nA:", "max_tokens": 4}) as r:
            return report, r.status, await r.json()

    report, status, answer = asyncio.run(_serving(cfg, work))
    # 4-bit codes, plus the lattices and row scales, which weigh more on rows of only 32 weights.
    assert report["quantization"] == "glvq" and 4 < report["bits_per_weight"] < 5.5
    assert status == 200 and answer["tokens"] == 4


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_field(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path)
    cfg.spec.model.architecture = training.ModelSpec.model_validate({**ARCHITECTURE, "width": 64})
    with pytest.raises(ValueError, match=r"^spec\.model\.architecture: .*holds another architecture"):
        serve.load_model(cfg)


def test_the_server_process_writes_its_port_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    config = tmp_path / "serve.json"
    config.write_text(_config(tmp_path).model_dump_json(by_alias=True))
    # HUORN_SERVE_PROFILE: the decoding loop under cProfile, written as the replica stops
    env = {**harness.child_env(), "HUORN_SERVE_PROFILE": str(tmp_path / "profile")}
    process = subprocess.Popen([sys.executable, "-m", "huorn.runtime.serve", "--config", str(config)],
                               cwd=harness.REPO, env=env, stderr=subprocess.PIPE, text=True)
    ready = tmp_path / "run" / "serve.json"
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-2000:]
        time.sleep(0.1)
    port = json.loads(ready.read_text())["port"]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Q: 1 + 1?\nA:", "max_tokens": 3}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["tokens"] == 3
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    written = list((tmp_path / "profile").glob("decode-*.prof"))
    assert len(written) == 1, process.stderr.read()[-2000:]
    stats = pstats.Stats(str(written[0]))
    profiled = {function for _, _, function in stats.stats}  # type: ignore[attr-defined]
    assert {"_decode", "step", "feed"} <= profiled  # the decoding loop's own work was watched


def test_at_sigterm_a_replica_stops_taking_connections_and_answers_the_request_in_flight(
        tmp_path: Path) -> None:
    """The drain a replica's grace period is sized for (inference.SERVE_DRAIN_SECONDS, after the
    preStop pause): SIGTERM closes the listening socket, so a new connection is refused, while
    the request already being answered is still answered in full before the process exits."""
    cfg = _config(tmp_path)

    async def scenario() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def slow(request: web.Request) -> web.Response:
            started.set()
            await release.wait()
            return web.json_response({"answer": 42})

        app = web.Application()
        app.router.add_get("/slow", slow)
        before = signal.getsignal(signal.SIGTERM)
        serving = asyncio.create_task(serve.run_until_signal(app, cfg, "drain.json", {}, "drain test"))
        record = Path(cfg.run_dir) / "drain.json"
        for _ in range(500):
            if record.exists() or serving.done():
                break
            await asyncio.sleep(0.01)
        assert not serving.done(), serving.exception()
        port = json.loads(record.read_text())["port"]
        async with aiohttp.ClientSession() as session:
            answer = asyncio.create_task(session.get(f"http://127.0.0.1:{port}/slow"))
            await asyncio.wait_for(started.wait(), 10)
            # the handler run_until_signal installed takes it (not whatever was there before, which
            # might end pytest)
            assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL, None)
            os.kill(os.getpid(), signal.SIGTERM)
            refused = False
            for _ in range(500):
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except ConnectionRefusedError:
                    refused = True
                    break
                writer.close()
                await asyncio.sleep(0.01)
            assert refused, "the replica kept listening after SIGTERM"
            await asyncio.sleep(1.0)  # a drain of a second or more: the answer is still awaited
            assert not answer.done(), "the request in flight was cut at SIGTERM"
            release.set()
            response = await asyncio.wait_for(answer, 10)
            assert response.status == 200 and await response.json() == {"answer": 42}
        await asyncio.wait_for(serving, 10)

    asyncio.run(scenario())


def test_a_failed_batch_is_answered_500_and_counted_and_a_cancelled_request_stops_nothing(
        tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")

    async def work(session, server, report):
        real = server.running.step
        calls = 0

        def step():
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("device lost")
            return real()

        server.running.step = step
        async with session.post("/v1/completions", json={"prompt": "Q: 1?\nA:", "max_tokens": 2}) as r:
            failed = (r.status, await r.json())
        # a request whose handler is gone (cancelled as the server stops) ahead of a live one: the
        # batch answers the live one, and the batching task lives on
        gone = serve.Request(list(b"Q: 2?\nA:"), 2, 0.0, 0)
        gone.done.cancel()
        server.queue.append(gone)
        bound = aiohttp.ClientTimeout(total=60)  # a dead batching task would answer nothing
        async with session.post("/v1/completions", json={"prompt": "Q: 3?\nA:", "max_tokens": 2},
                                timeout=bound) as r:
            answered = r.status
        async with session.post("/v1/completions", json={"prompt": "Q: 44?\nA:", "max_tokens": 2},
                                timeout=bound) as r:
            after = r.status
        async with session.get("/metrics") as r:
            return failed, answered, after, await r.text()

    (status, body), answered, after, metrics = asyncio.run(_serving(_config(tmp_path), work))
    assert status == 500 and "device lost" in body["error"]["message"]
    assert 'huorn_serve_requests_total{outcome="failed"} 1.0' in metrics
    assert answered == 200 and after == 200
    assert "huorn_serve_in_flight 0.0" in metrics


def test_a_streamed_answer_is_the_same_answer_a_token_at_a_time(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    prompt = {"temperature": 0, "prompt": "Q: What is 1 + 2?\nA:", "max_tokens": 12}

    async def work(session, server, report):
        async with session.post("/v1/completions", json=prompt) as r:
            whole = await r.json()
        async with session.post("/v1/completions", json={**prompt, "stream": True}) as r:
            kind = r.headers["Content-Type"]
            events = [line[len("data: "):] for line in (await r.text()).split("\n\n") if line]
        async with session.post("/v1/completions", json={**prompt, "stream": "yes"}) as r:
            refused = (r.status, await r.json())
        async with session.get("/metrics") as r:
            return whole, kind, events, refused, await r.text()

    whole, kind, events, refused, metrics = asyncio.run(_serving(_config(tmp_path), work))
    assert kind.startswith("text/event-stream") and events[-1] == "[DONE]"
    pieces = [json.loads(e) for e in events[:-1]]
    *texts, done = pieces
    assert len(texts) > 1  # more than one event: it streamed
    assert "".join(t["text"] for t in texts) == whole["text"]
    assert done["done"] is True and done["tokens"] == whole["tokens"] == 12
    assert refused[0] == 400 and refused[1]["error"]["message"].startswith("stream:")
    assert "huorn_serve_time_to_first_token_seconds_count 2.0" in metrics


def test_a_model_with_more_tokens_than_bytes_answers_text(tmp_path: Path) -> None:
    """Prompts are bytes: a model with a larger vocabulary chooses among the bytes only (an id
    past 255 has no text, and failed the batch)."""
    architecture = {**ARCHITECTURE, "vocabulary": 4096}
    spec = training.ModelSpec.model_validate(architecture)
    torch.manual_seed(0)
    model = models.build_model(run_config.build_model_config(spec))
    checkpoint.save_checkpoint(tmp_path / "ckpt", 1, model, torch.optim.AdamW(model.parameters()),
                               {"model": spec.to_wire()}, rank=0, barrier=lambda: None)
    cfg = _config(tmp_path)
    cfg.spec.model.architecture = spec

    async def work(session, server, report):
        async with session.post("/v1/completions", json={"prompt": "Q: 1?\nA:", "max_tokens": 20,
                                                         "temperature": 1.0}) as r:
            return r.status, await r.json()

    status, body = asyncio.run(_serving(cfg, work))
    assert status == 200 and body["tokens"] == 20 and isinstance(body["text"], str)


def test_a_byte_beyond_a_small_vocabulary_is_refused_and_fails_no_other_request(tmp_path: Path) -> None:
    """A model of 128 tokens (the API allows 2 up) has no embedding for 'é''s bytes: its
    IndexError failed every request of the batch the prompt joined."""
    _saved_model(tmp_path / "ckpt", vocabulary=128)
    cfg = _config(tmp_path, {"vocabulary": 128})

    async def work(session, server, report):
        async def ask(body: dict) -> tuple[int, dict]:
            async with session.post("/v1/completions", json=body) as r:
                return r.status, await r.json()

        plain = ask({"prompt": "Q: 1?\nA:", "max_tokens": 30, "temperature": 0})
        return await asyncio.gather(plain, ask({"prompt": "café", "max_tokens": 4}),
                                    ask({"prompt": ["ok", [65, 200]], "max_tokens": 4}))

    (ok, answer), (refused, error), (second, listed) = asyncio.run(_serving(cfg, work))
    assert ok == 200 and answer["tokens"] == 30
    assert refused == 400 and error["error"]["message"].startswith(
        "prompt: byte 195 is beyond the model's vocabulary of 128 tokens")
    assert second == 400 and listed["error"]["message"].startswith("prompt[1]: byte 200")


def test_answers_carry_openais_completion_fields_and_a_wrong_model_is_404(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    prompt = {"model": "chat", "prompt": "Q: 1 + 1?\nA:", "max_tokens": 5, "temperature": 0}

    async def work(session, server, report):
        async with session.get("/v1/models") as r:
            models_list = await r.json()
        async with session.post("/v1/completions", json=prompt) as r:
            answer = await r.json()
        async with session.post("/v1/completions", json={**prompt, "stream": True}) as r:
            events = _sse_events(await r.text())
        async with session.post("/v1/completions", json={**prompt, "model": "gpt-4"}) as r:
            wrong = (r.status, await r.json())
        return models_list, answer, events, wrong

    models_list, answer, events, wrong = asyncio.run(_serving(_config(tmp_path), work))
    assert [m["id"] for m in models_list["data"]] == ["chat"]
    assert answer["object"] == "text_completion" and answer["model"] == "chat"
    assert answer["id"].startswith("cmpl-")
    choice = {"index": 0, "text": answer["text"], "logprobs": None, "finish_reason": "length"}
    assert answer["choices"] == [choice]
    prompt_tokens = len(prompt["prompt"].encode())
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                               "total_tokens": prompt_tokens + 5,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == answer["text"] and len({e["id"] for e in events}) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 5
    message = wrong[1]["error"]["message"]
    assert wrong[0] == 404 and "'chat'" in message and "/v1/models" in message
    assert wrong[1]["error"]["code"] == "model_not_found" and wrong[1]["error"]["param"] == "model"


def test_an_answer_ends_before_its_stop_sequence_streamed_or_not_and_decoding_stops_early(
        tmp_path: Path) -> None:
    model = _saved_model(tmp_path / "ckpt")
    prompt = "Q: What is 1 + 2?\nA:"
    greedy = model.generate(torch.tensor([list(prompt.encode())]), 24)[0, len(prompt.encode()):].tolist()
    # a stop sequence the greedy answer holds: its first ASCII byte after the first token
    at = next(i for i, t in enumerate(greedy) if i > 0 and t < 128)
    stop = chr(greedy[at])
    cut = greedy.index(greedy[at])  # where the answer first holds it
    request = {"temperature": 0, "prompt": prompt, "max_tokens": 24, "stop": [stop, "\u00e9never"]}

    async def work(session, server, report):
        steps = 0
        forward = server.model.forward_step

        def counted(*args, **kwargs):
            nonlocal steps
            steps += 1
            return forward(*args, **kwargs)

        server.model.forward_step = counted
        async with session.post("/v1/completions", json=request) as r:
            whole = await r.json()
        decoded = steps
        async with session.post("/v1/completions", json={**request, "stream": True}) as r:
            events = _sse_events(await r.text())
        async with session.post("/v1/completions", json={**request, "stop": ["a", "b", "c", "d", "e"]}) as r:
            refused = (r.status, await r.json())
        return whole, decoded, events, refused

    whole, decoded, events, refused = asyncio.run(_serving(_config(tmp_path), work))
    assert whole["tokens"] == cut and whole["text"] == tokenizer.decode(greedy[:cut])
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert decoded == 1 + cut  # the prefill, then one step per token up to the stop's: no more
    assert "".join(e.get("text", "") for e in events) == whole["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert refused[0] == 400 and refused[1]["error"]["message"].startswith("stop:")


def test_the_chat_api_answers_a_conversation_and_its_next_turn_finds_the_last_cached(tmp_path: Path) -> None:
    model = _saved_model(tmp_path / "ckpt", ascii_only=True, context=256)
    messages = [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": "What is the capital of France?"}]

    async def work(session, server, report):
        first_turn = {"temperature": 0, "messages": messages, "max_tokens": 8}
        async with session.post("/v1/chat/completions", json=first_turn) as r:
            first = await r.json()
        turn = [*messages, first["choices"][0]["message"], {"role": "user", "content": "And of Peru?"}]
        next_turn = {"temperature": 0, "messages": turn, "max_tokens": 4, "stream": True}
        async with session.post("/v1/chat/completions", json=next_turn) as r:
            events = _sse_events(await r.text())
        bad = [*messages, {"role": "robot", "content": "hi"}]
        async with session.post("/v1/chat/completions", json={"messages": bad}) as r:
            refused = (r.status, await r.json())
        return first, turn, events, refused

    cfg = _config(tmp_path, {"context": 256}, serving={"maxBatch": 8, "maxTokens": 256})
    first, turn, events, refused = asyncio.run(_serving(cfg, work))
    prompt = chat.render(messages)
    assert prompt == "system: Answer in one line.\nuser: What is the capital of France?\nassistant: "
    greedy = model.generate(torch.tensor([list(prompt.encode())]), 8)[0, len(prompt.encode()):].tolist()
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(greedy)}
    assert first["choices"][0]["finish_reason"] == "length"
    # the next turn: everything up to its new message was in the last prompt and answer
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert first["text"].isascii()
    # the last prompt (76 bytes: four whole blocks) and 7 of its answer's 8 tokens (the last was
    # never fed back): 83 bytes, five whole blocks
    assert len(prompt) == 76
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    assert events[-1]["usage"]["prompt_tokens"] == len(chat.render(turn).encode())
    assert refused[0] == 400 and refused[1]["error"]["message"].startswith("messages[2].role: 'robot'")


def test_a_stream_holds_back_only_bytes_that_may_begin_a_stop_and_the_earliest_stop_ends_the_answer() -> None:
    """A stop's bytes are held until they either complete it or turn out to be text; the others
    go at once. Of stops that end at the same byte the longest began first: the answer ends there,
    whatever order the stops were given in."""
    async def check() -> tuple[list[bytes], str | None, list[int]]:
        request = serve.Request([1], 20, 0.0, 0, stream=asyncio.Queue(), stop=(b"\nuser:", b"b", b"ab"))
        answer = continuous_batching.Answer(request)
        sent = []
        for piece in (b"xy\nu", b"z", b"a", b"b"):
            for byte in piece:
                answer.add(byte)
            await asyncio.sleep(0)  # the tokens go through the loop, as from the decoding thread
            sent.append(bytes(request.stream.get_nowait()[1] for _ in range(request.stream.qsize())))
        return sent, answer.finished, answer.tokens

    sent, finished, tokens = asyncio.run(check())
    assert sent == [b"xy", b"\nuz", b"", b""]
    assert finished == "stop" and bytes(tokens) == b"xy\nuz"


def test_a_streamed_chat_answer_is_the_answer_sent_whole(tmp_path: Path) -> None:
    """A chat's stops are 8 bytes long: a stream that holds bytes back must send each once."""
    _saved_model(tmp_path / "ckpt", ascii_only=True, context=256)
    request = {"temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 24}

    async def work(session, server, report):
        async with session.post("/v1/chat/completions", json=request) as r:
            whole = await r.json()
        async with session.post("/v1/chat/completions", json={**request, "stream": True}) as r:
            events = _sse_events(await r.text())
        return whole, events

    cfg = _config(tmp_path, {"context": 256}, serving={"maxBatch": 8, "maxTokens": 256})
    whole, events = asyncio.run(_serving(cfg, work))
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == whole["choices"][0]["message"]["content"] and whole["tokens"] > 8


def test_fields_left_null_take_their_defaults_and_a_body_or_field_of_the_wrong_kind_is_400_naming_it(
        tmp_path: Path) -> None:
    """Clients written for OpenAI send null for a field they leave to the server, and chat ones
    max_completion_tokens (or no cap at all: the answer runs to its stop); a body that is not an
    object is a client's error, not the server's."""
    _saved_model(tmp_path / "ckpt")
    messages = [{"role": "user", "content": "Hi?"}]
    nulls = {"max_tokens": None, "temperature": None, "seed": None, "stop": None, "stream": None}
    cases = [
        ("/v1/completions", {"prompt": "Q: 1?\nA:", **nulls}, 200, "16 tokens"),
        ("/v1/chat/completions", {"messages": messages, **nulls, "max_completion_tokens": 5}, 200,
         "5 tokens"),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "max_completion_tokens": 5}, 200,
         "5 tokens"),
        ("/v1/chat/completions", {"messages": messages}, 200, "all that fits"),
        ("/v1/chat/completions", [messages], 400, "the body:"),
        ("/v1/completions", "Q: 1?", 400, "the body:"),
        ("/v1/completions", {"prompt": "Q: 1?", "max_tokens": "12"}, 400, "max_tokens: give an integer"),
        ("/v1/completions", {"prompt": "Q: 1?", "max_tokens": 2.5}, 400, "max_tokens: give an integer"),
        ("/v1/completions", {"prompt": "Q: 1?", "seed": True}, 400, "seed: give an integer"),
        # an absurd n, no seed given: n is named, not the seed range it pushes the default out of
        ("/v1/completions", {"prompt": "Q: 1?", "n": 2**70}, 400, "n: give 1 to"),
        ("/v1/completions", {"prompt": "Q: 1?", "seed": 2**64}, 400, "seed: give an integer from"),
        ("/v1/completions", {"prompt": "Q: 1?", "temperature": "hot"}, 400, "temperature: give a number"),
        ("/v1/completions", {"prompt": "Q: 1?", "temperature": -1}, 400, "temperature: give a finite"),
        ("/v1/chat/completions", {"messages": messages, "max_completion_tokens": 0}, 400,
         "max_completion_tokens: give 1 or more"),
    ]

    async def work(session, server, report):
        answers = []
        for path, body, _, _ in cases:
            async with session.post(path, json=body) as r:
                answers.append((r.status, await r.json()))
        # bodies that no JSON object comes out of: nested past the parser's depth (a 500 once),
        # and a charset no codec has
        for data, kind in (("[" * 100_000, "application/json"),
                           ('{"prompt": "x"}', "application/json; charset=bogus")):
            async with session.post("/v1/completions", data=data, headers={"Content-Type": kind}) as r:
                raw.append((r.status, await r.json()))
        async with session.get("/metrics") as r:
            return answers, await r.text()

    raw: list[tuple[int, dict]] = []
    answers, metrics = asyncio.run(_serving(_config(tmp_path), work))
    assert [status for status, _ in raw] == [400, 400], raw
    assert raw[0][1]["error"]["message"] == "the body: JSON nested too deeply"
    for (path, body, status, what), (got, answer) in zip(cases, answers, strict=True):
        assert got == status, (path, body, answer)
        if status == 400:
            assert answer["error"]["message"].startswith(what), (body, answer)
    prompt = len(chat.render(messages).encode())
    assert [a["usage"]["completion_tokens"] for _, a in answers[:3]] == [16, 5, 5]
    assert answers[3][1]["usage"]["completion_tokens"] <= 48 - prompt  # spec.serving.maxTokens
    assert answers[3][1]["choices"][0]["finish_reason"] == "stop" or \
        answers[3][1]["usage"]["completion_tokens"] == 48 - prompt
    assert 'huorn_serve_requests_total{outcome="refused"} 12.0' in metrics


def test_a_chat_stream_names_its_role_once_and_a_failed_stream_ends_with_openais_error_shape(
        tmp_path: Path) -> None:
    """The openai SDK joins a stream's deltas field by field (a role in every chunk reads
    "assistantassistant...") and raises an error event with its `error.message` (a bare string
    reads "An error occurred during streaming")."""
    _saved_model(tmp_path / "ckpt", ascii_only=True)
    request = {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 6, "stream": True}

    async def work(session, server, report):
        async def events() -> list[dict]:
            async with session.post("/v1/chat/completions", json=request) as r:
                return _sse_events(await r.text())

        answered = await events()

        def step():
            raise RuntimeError("device lost")

        server.running.step = step
        return answered, await events()

    answered, failed = asyncio.run(_serving(_config(tmp_path), work))
    deltas = [e["choices"][0]["delta"] for e in answered]
    assert deltas[0]["role"] == "assistant" and not any("role" in d for d in deltas[1:])
    assert answered[-1]["choices"][0]["finish_reason"] == "length"
    assert failed[-1]["error"]["message"].startswith("generation failed: RuntimeError('device lost')")
    assert failed[-1]["error"]["type"] == "server_error"


def _count_decode_steps(server: serve.Server) -> list[int]:
    """The model's forward passes (prefills and decoding steps), at a real model's pace (5 ms a
    step: a hang-up is seen long before 200 of them)."""
    forward, steps = server.model.forward_step, []

    def slow(*args, **kwargs):
        time.sleep(0.005)
        steps.append(1)
        return forward(*args, **kwargs)

    server.model.forward_step = slow
    return steps


@pytest.mark.parametrize("streamed", [True, False])
def test_a_request_whose_client_hangs_up_stops_decoding_and_is_counted_abandoned(
        tmp_path: Path, streamed: bool) -> None:
    """A chat UI's stop button closes a stream; a client's time-out closes a plain request before
    its retry, which under load waits behind the decode it left. The replica must not decode the
    rest for no one (a closed connection cancels its handler, as the serving process runs it),
    nor log a traceback, and its gauges must come back."""
    _saved_model(tmp_path / "ckpt", context=256)
    cfg = _config(tmp_path, {"context": 256}, serving={"maxBatch": 8, "maxTokens": 256})

    async def work(session, server, report):
        decoded = _count_decode_steps(server)
        if streamed:
            async with aiohttp.ClientSession(str(session._base_url)) as other:
                r = await other.post("/v1/completions", json={"prompt": "Q: 1?\nA:", "max_tokens": 200,
                                                              "stream": True})
                await r.content.readuntil(b"\n\n")
                r.close()  # the client hangs up
        else:
            with pytest.raises(TimeoutError):
                async with session.post("/v1/completions", json={"prompt": "Q: 1?\nA:", "max_tokens": 200},
                                        timeout=aiohttp.ClientTimeout(total=0.2)) as r:
                    await r.read()
        async with session.post("/v1/completions", json={"prompt": "Q: 2?\nA:", "max_tokens": 2},
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            after = r.status
        async with session.get("/metrics") as r:
            return decoded, after, await r.text()

    decoded, after, metrics = asyncio.run(_serving(cfg, work))
    assert len(decoded) < 100 and after == 200  # 200 tokens asked for, then 2
    # what it decoded before its client went is counted, streamed or not
    assert _metric(metrics, "huorn_serve_generated_tokens_total") > 2
    assert 'huorn_serve_requests_total{outcome="abandoned"} 1.0' in metrics
    assert 'huorn_serve_requests_total{outcome="ok"} 1.0' in metrics
    assert "huorn_serve_in_flight 0.0" in metrics


def test_past_the_drain_the_decoding_thread_stops_and_the_queue_is_dropped(tmp_path: Path) -> None:
    """At the drain's end the runner cancels the handlers still waiting and runs on_cleanup. The
    decoding thread went on decoding every queued request for no one, and the process waited for
    it: 32 cut requests decoded, the pod exiting 21 s after SIGTERM instead of 4 (a reviewer's run
    with a 2 s drain)."""
    _saved_model(tmp_path / "ckpt", context=256)
    cfg = _config(tmp_path, {"context": 256}, serving={"maxBatch": 1, "maxTokens": 256})

    async def check() -> tuple[int, int, int, list[serve.Request]]:
        model, _ = serve.load_model(cfg)
        server = serve.Server(cfg, model)
        steps = _count_decode_steps(server)
        app = server.app()
        app.freeze()  # as the runner does
        await app.startup()
        requests = [serve.Request([1, 2, 3], 200, 0.0, 0) for _ in range(5)]
        with server.queue_lock:
            server.queue.extend(requests)
        server.wake.set()
        while not steps:
            await asyncio.sleep(0.01)
        await app.shutdown()
        await app.cleanup()  # the drain is over: the handlers are gone
        at_cleanup = len(steps)
        await asyncio.sleep(0.3)  # 60 steps' time at 5 ms a step
        return at_cleanup, len(steps), len(server.queue), requests

    at_cleanup, later, queued, requests = asyncio.run(check())
    assert later - at_cleanup <= 1 and queued == 0  # the step in flight at most
    assert not any(r.done.done() for r in requests[1:])  # never decoded


def test_a_row_is_answered_as_it_ends_not_when_its_batch_does(tmp_path: Path) -> None:
    """A short answer (or one at its stop) batched with a long one: its client has it, and a
    stream its [DONE], as soon as its own row ends."""
    _saved_model(tmp_path / "ckpt", context=256)
    cfg = _config(tmp_path, {"context": 256}, serving={"maxBatch": 8, "maxTokens": 256})

    async def work(session, server, report):
        forward = server.model.forward_step

        def slow(*args, **kwargs):
            time.sleep(0.005)  # 200 steps take a second or more
            return forward(*args, **kwargs)

        server.model.forward_step = slow
        real, entered, gate = server.running.admit, asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def admit(admitted):
            if admitted and len(admitted[0].tokens) == 1:  # holds the batcher until both are queued
                loop.call_soon_threadsafe(entered.set)
                gate.wait(60)
            return real(admitted)

        server.running.admit = admit

        async def ask(prompt: str, tokens: int, stream: bool) -> str:
            async with session.post("/v1/completions", json={"prompt": prompt, "max_tokens": tokens,
                                                              "stream": stream}) as r:
                return await r.text()

        held = asyncio.create_task(ask("Q", 1, False))
        await asyncio.wait_for(entered.wait(), 60)
        long = asyncio.create_task(ask("Q: 1?\nA:", 200, False))
        short = asyncio.create_task(ask("Q: 2?\nA:", 2, True))
        while len(server.queue) < 2:  # both admitted together
            await asyncio.sleep(0.01)
        gate.set()
        await held
        text = await asyncio.wait_for(short, 60)
        pending = not long.done()
        await long
        return text, pending

    text, long_pending = asyncio.run(_serving(cfg, work))
    assert text.endswith("data: [DONE]\n\n") and long_pending


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_request_arriving_mid_decode_joins_it_and_answers_as_greedy_decoding_alone(
        tmp_path: Path, batching: str) -> None:
    """A short request of another prompt length, sent while a long answer decodes: with
    continuous batching it joins at the next step and is answered long before the long one ends,
    both exactly as each decoded alone; with static batching it waits for the long one."""
    model = _saved_model(tmp_path / "ckpt", context=256)
    cfg = _config(tmp_path, {"context": 256}, serving={"maxBatch": 8, "maxTokens": 256, "batching": batching})
    long_prompt, short_prompt = "Q: What is 1 + 2?\nA:", "Q: Hi?\nA:"

    async def work(session, server, report):
        steps = _count_decode_steps(server)  # 5 ms a forward pass: 150 steps take 0.75 s or more

        async def ask(prompt: str, tokens: int) -> tuple[dict, int]:
            body = {"temperature": 0, "prompt": prompt, "max_tokens": tokens}
            async with session.post("/v1/completions", json=body) as r:
                return await r.json(), len(steps)

        long = asyncio.create_task(ask(long_prompt, 150))
        while len(steps) < 10:  # the long one is decoding
            await asyncio.sleep(0.005)
        short, at = await ask(short_prompt, 4)
        (long_answer, long_at) = await long
        async with session.get("/metrics") as r:
            return long_answer, short, at, long_at, await r.text()

    long_answer, short, short_at, long_at, metrics = asyncio.run(_serving(cfg, work))
    for prompt, answer, tokens in ((long_prompt, long_answer, 150), (short_prompt, short, 4)):
        ids = torch.tensor([list(prompt.encode())])
        expected = model.generate(ids, tokens)[0, ids.shape[1]:].tolist()
        assert answer["text"] == bytes(expected).decode("utf-8", errors="replace")
    # a gap before each token but an answer's first: 149 and 3
    assert _metric(metrics, "huorn_serve_inter_token_seconds_count") == 149 + 3
    # rows decoded a step, summed over the steps: each step past one row is a step shared
    shared = _metric(metrics, "huorn_serve_batch_size_sum") - _metric(metrics, "huorn_serve_batch_size_count")
    if batching == "continuous":
        assert short_at < 40 < long_at  # a prefill and 4 steps after it came, not after 150
        assert shared == 4  # a step for each of its 4 tokens, beside the long one
    else:
        assert short_at > 150  # behind the whole long answer
        assert short["queue_seconds"] > long_answer["seconds"] / 2 and shared == 0


def test_a_chat_with_no_cap_ends_at_the_default_rather_than_the_whole_context(tmp_path: Path) -> None:
    """No end-of-turn token: a chat that names no cap would otherwise decode to the context."""
    _saved_model(tmp_path / "ckpt", context=512)
    cfg = _config(tmp_path, {"context": 512}, serving={"maxBatch": 8, "maxTokens": 512})

    async def work(session, server, report):
        body = {"messages": [{"role": "user", "content": "Hi?"}]}
        async with session.post("/v1/chat/completions", json=body) as r:
            return await r.json()

    answer = asyncio.run(_serving(cfg, work))
    assert answer["usage"]["completion_tokens"] == serve.CHAT_DEFAULT_TOKENS or \
        answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] <= serve.CHAT_DEFAULT_TOKENS



def test_logprobs_are_the_models_own_distribution_streamed_or_not_in_both_apis(tmp_path: Path) -> None:
    """`logprobs` (completions: N alternatives; chat: true with top_logprobs): each chosen token's
    log-probability is log_softmax of the model's logits at its position (a full forward over the
    prompt and answer), temperature aside; a stream's chunks carry the same numbers as the whole
    answer, with offsets that continue across chunks; a stop sequence's tokens are not reported."""
    model = _saved_model(tmp_path / "ckpt")
    prompt = "Q: What is 1 + 2?\nA:"
    ask = {"temperature": 0, "prompt": prompt, "max_tokens": 8, "logprobs": 3}
    answer = model.generate(torch.tensor([list(prompt.encode())]), 8)[0, len(prompt.encode()):].tolist()
    at = next(i for i, t in enumerate(answer) if i > 0 and t < 128)  # a stop the greedy answer holds

    async def work(session, server, report):
        async def post(path: str, body: dict) -> tuple[int, object]:
            async with session.post(path, json=body) as r:
                return r.status, (await r.text() if body.get("stream") else await r.json())

        _, greedy = await post("/v1/completions", ask)
        _, hot = await post("/v1/completions", {**ask, "temperature": 1.5, "seed": 3})
        _, streamed = await post("/v1/completions", {**ask, "stream": True})
        hi = {"temperature": 0, "messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 5}
        _, chatted = await post("/v1/chat/completions", {**hi, "logprobs": True, "top_logprobs": 2})
        _, plain = await post("/v1/completions", {**ask, "logprobs": None})
        _, stopped = await post("/v1/completions", {**ask, "stop": chr(answer[at])})
        return greedy, hot, streamed, chatted, plain, stopped

    greedy, hot, streamed, chatted, plain, stopped = asyncio.run(_serving(_config(tmp_path), work))
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["logprobs"]["tokens"] == greedy["choices"][0]["logprobs"]["tokens"][:at]

    def reference(text_tokens: list[int], answer: list[int]) -> torch.Tensor:
        ids = torch.tensor([text_tokens + answer])
        with torch.no_grad():
            logits = model(ids)[0][0, len(text_tokens) - 1: -1, : tokenizer.VOCABULARY].float()
        return torch.log_softmax(logits, dim=-1)

    for answer in (greedy, hot):
        got = answer["choices"][0]["logprobs"]
        ids = [ord(t) if len(t) == 1 else int(t[-2:], 16) for t in got["tokens"]]  # "bytes:\\xNN"
        assert bytes(ids).decode("utf-8", errors="replace") == answer["choices"][0]["text"]
        assert len(ids) == answer["usage"]["completion_tokens"] == 8
        want = reference(list(prompt.encode()), ids)
        chosen = want.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["token_logprobs"]), chosen, atol=1e-4)
        for position, top in enumerate(got["top_logprobs"]):
            best = want[position].topk(3)
            expected = {serve.logprobs.token_text(int(t)): float(v) for v, t in zip(*best, strict=True)}
            expected[got["tokens"][position]] = float(chosen[position])
            assert top.keys() == expected.keys()
            assert all(abs(top[k] - expected[k]) < 1e-4 for k in top)
    # greedy: each chosen token is the likeliest, so it is one of the three
    assert all(len(top) == 3 for top in greedy["choices"][0]["logprobs"]["top_logprobs"])
    assert plain["choices"][0]["logprobs"] is None

    events = _sse_events(streamed)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    whole = greedy["choices"][0]["logprobs"]
    for name in ("tokens", "text_offset"):
        assert [x for part in parts for x in part[name]] == whole[name]
    assert [x for part in parts for x in part["token_logprobs"]] == pytest.approx(whole["token_logprobs"])

    content = chatted["choices"][0]["logprobs"]["content"]
    assert len(content) == chatted["usage"]["completion_tokens"]
    assert bytes(b for item in content for b in item["bytes"]).decode("utf-8", errors="replace") == \
        chatted["choices"][0]["message"]["content"]
    assert all(len(item["top_logprobs"]) == 2 and item["logprob"] <= 0 for item in content)


def test_streamed_text_offsets_are_the_whole_answers_when_a_chunk_begins_inside_a_character(
        tmp_path: Path) -> None:
    """An answer of bytes c3 e2 82 ac (a lone lead byte, then €): the chunk that shows the lead
    byte's U+FFFD holds e2, whose character comes in the next chunk. Each token's text_offset is
    the characters decoded before it, streamed or not (the next chunk counted 82 as a U+FFFD of
    its own, and gave ac the offset 2)."""
    _saved_model(tmp_path / "ckpt")
    script = [0xC3, 0xE2, 0x82, 0xAC]

    def scripted(self: continuous_batching.RunningBatch) -> tuple[list[int], list]:
        logits = torch.stack([row.logits for row in self.rows])[:, : tokenizer.VOCABULARY]
        chosen = [script[len(row.chosen)] for row in self.rows]
        return chosen, continuous_batching.measure(logits, chosen, [1] * len(self.rows))

    async def work(session, server, report):
        server.running.choose = scripted.__get__(server.running)
        ask = {"prompt": "Q: Hi?\nA:", "max_tokens": len(script), "logprobs": 1}
        async with session.post("/v1/completions", json=ask) as r:
            whole = await r.json()
        async with session.post("/v1/completions", json={**ask, "stream": True}) as r:
            events = _sse_events(await r.text())
        return whole, events

    whole, events = asyncio.run(_serving(_config(tmp_path), work))
    assert whole["choices"][0]["text"] == "\ufffd€"
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 0, 1, 1]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    assert "".join(e["choices"][0]["text"] for e in events) == "\ufffd€"
    assert [x for part in parts for x in part["tokens"]] == whole["choices"][0]["logprobs"]["tokens"]
    assert [x for part in parts for x in part["text_offset"]] == [0, 0, 1, 1]


def test_a_prompt_in_each_of_openais_forms_and_several_prompts_in_one_request(tmp_path: Path) -> None:
    """OpenAI's forms of one prompt (a string, its token ids, a list of either holding one, as
    LangChain sends it) answer alike; a list of several (evaluation harnesses batch theirs so) is
    answered as choices in order, prompt i's `n` choices at i * n ... i * n + n - 1, each what that
    prompt alone gets, its usage counting each prompt once; a bad one is refused naming its index."""
    _saved_model(tmp_path / "ckpt")
    text = "Q: é?\nA:"
    ids = list(text.encode())
    others = ["Q: What is 1 + 2?\nA:", "Hi"]
    bodies = [{"temperature": 0, "prompt": p} for p in (
        text, ids, [text], [ids], [300], [], [True], ["a", ""], ["a", [1, 300]], ["a"] * (MAX_PROMPTS + 1))]
    hot = {"max_tokens": 4, "temperature": 1.0, "seed": 7}

    async def work(session, server, report):
        async def post(body: dict) -> tuple[int, dict]:
            async with session.post("/v1/completions", json=body) as r:
                return r.status, (await r.text() if body.get("stream") else await r.json())

        answers = [await post({**body, "max_tokens": 4}) for body in bodies]
        alone = [(await post({"prompt": p, **hot, "n": 2}))[1] for p in [text, *others]]
        _, batched = await post({"prompt": [ids, *others], **hot, "n": 2})
        _, streamed = await post({"prompt": [text, *others], **hot, "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}})
        return answers, alone, batched, streamed

    answers, alone, batched, streamed = asyncio.run(_serving(_config(tmp_path), work))
    served, refused = answers[:4], answers[4:]
    assert [status for status, _ in served] == [200] * 4
    assert len({body["text"] for _, body in served}) == 1
    assert all(body["usage"]["prompt_tokens"] == len(ids) for _, body in served)
    assert [status for status, _ in refused] == [400] * 6
    errors = [body["error"]["message"] for _, body in refused]
    assert [e.split(":")[0] for e in errors] == ["prompt"] * 3 + ["prompt[1]"] * 2 + ["prompt"]
    assert "at most 2048" in errors[-1]

    expected = [c["text"] for answer in alone for c in answer["choices"]]
    assert [c["index"] for c in batched["choices"]] == list(range(6))
    assert [c["text"] for c in batched["choices"]] == expected
    assert batched["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batched["usage"]["completion_tokens"] == 6 * 4
    *events, usage = _sse_events(streamed)
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage["usage"][name] == batched["usage"][name]
    for index, want in enumerate(expected):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert "".join(e["choices"][0]["text"] for e in mine) == want


def _reference_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log_softmax over the bytes at every position of one full forward pass: row i is the
    distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0][0, :, : tokenizer.VOCABULARY].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask_whole_chunked_cached_or_streamed(
        tmp_path: Path) -> None:
    """`echo` with `logprobs` (what lm-evaluation-harness sends to score a text: echo, logprobs 1,
    max_tokens 1 or 0, temperature 0, its prompts batched): the text begins with the prompt's,
    its log-probabilities with the prompt's, each the model's own (log_softmax of one full forward
    pass), the first null; the same when the prompt's prefill is chunked, when its blocks are in
    the prefix cache (a cached block has no logits: a scored prompt is prefilled whole), and when
    streamed. max_tokens 0 answers nothing; echo without logprobs only prepends the text."""
    model = _saved_model(tmp_path / "ckpt")
    context, continuation = "Q: What is 1 + 2?\nA:", " 3"
    text = context + continuation
    ids = list(text.encode())
    scored = {"prompt": [text, "Hi there"], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    serving = {"maxBatch": 8, "maxTokens": 48, "prefixCacheTokens": 256}

    async def work(session, server, report):
        async def post(body: dict) -> dict | str:
            async with session.post("/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.text() if body.get("stream") else await r.json()

        # its blocks now in the prefix cache
        plain = await post({"temperature": 0, "prompt": text, "max_tokens": 3})
        first = await post(scored)
        nothing = await post({**scored, "max_tokens": 0, "logprobs": 3})
        streamed = await post({**scored, "stream": True})
        streamed_nothing = await post({**scored, "max_tokens": 0, "stream": True})
        text_only = await post({"temperature": 0, "prompt": text, "echo": True, "max_tokens": 3})
        return plain, first, nothing, streamed, streamed_nothing, text_only

    results = {}
    for chunk in (0, 8):
        cfg = _config(tmp_path, serving={**serving, "prefillChunkTokens": chunk})
        results[chunk] = asyncio.run(_serving(cfg, work))
    plain, first, nothing, streamed, streamed_nothing, text_only = results[0]

    want = _reference_logprobs(model, ids)
    for answer in (first, results[8][1]):
        choice = answer["choices"][0]
        got = choice["logprobs"]
        assert choice["text"].startswith(text) and len(got["tokens"]) == len(ids) + 1
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        chosen = want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["token_logprobs"][1:len(ids)]), chosen, atol=1e-4)
        assert got["text_offset"][:len(ids)] == list(range(len(ids)))  # ASCII: a character a byte
        # what the harness computes: the continuation's log-likelihood, and whether it is greedy
        ctxlen = len(context.encode())
        harness_sum = sum(got["token_logprobs"][ctxlen:-1])
        assert harness_sum == pytest.approx(float(chosen[ctxlen - 1:].sum()), abs=1e-4)
        assert len(answer["choices"]) == 2 and answer["choices"][1]["text"].startswith("Hi there")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # scored whole, not from the cache

    choice = nothing["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert nothing["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(ids)
    # the 3 likeliest, and the prompt's own token where it is not one of them
    assert all(len(top) in (3, 4) for top in choice["logprobs"]["top_logprobs"][1:])
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(first["choices"][0]["logprobs"]
                                                                     ["token_logprobs"][1:len(ids)], abs=1e-6)

    for body, whole in ((streamed, first), (streamed_nothing, nothing)):
        events = [e for e in _sse_events(body) if e["choices"] and e["choices"][0]["index"] == 0]
        assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
        parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
        for name in ("tokens", "text_offset"):
            assert [x for part in parts for x in part[name]] == \
                whole["choices"][0]["logprobs"][name][:len(ids) + (whole is first)]
        streamed_logprobs = [x for part in parts for x in part["token_logprobs"]]
        assert streamed_logprobs[0] is None
        whole_logprobs = whole["choices"][0]["logprobs"]["token_logprobs"]
        assert streamed_logprobs[1:len(ids)] == pytest.approx(whole_logprobs[1:len(ids)], abs=1e-6)

    assert text_only["choices"][0]["text"] == text + plain["choices"][0]["text"]
    assert text_only["choices"][0]["logprobs"] is None and text_only["usage"]["completion_tokens"] == 3


def test_a_scored_prompt_is_answered_even_when_the_step_after_its_prefill_fails(tmp_path: Path) -> None:
    """max_tokens 0 with echo is answered as its prefill ends, taken out of the batch: if the
    decoding step of that same iteration failed, it was in neither the rows nor the batch's early
    answers, and its client waited for ever. Now it is answered before the step; the running
    request fails with the step."""
    _saved_model(tmp_path / "ckpt")

    async def work(session, server, report):
        running = server.running
        take_early, step, took = running.take_early, running.step, []
        queued = threading.Event()  # the scored request waits in the queue

        def recording() -> list:
            took.append(early := take_early())
            return early

        def failing() -> list:
            queued.wait(10)  # the running request's first step waits for the scored one to queue
            if took and took[-1]:  # the iteration that answered a scored prompt
                raise RuntimeError("the device went away")
            return step()

        running.take_early, running.step = recording, failing

        async def post(body: dict) -> tuple[int, dict]:
            async with session.post("/v1/completions", json=body) as r:
                return r.status, await r.json()

        long = asyncio.create_task(post({"prompt": "Q: Hi?\nA:", "max_tokens": 20}))
        while not len(running):  # decoding: its first step holds
            await asyncio.sleep(0.01)
        scored = asyncio.create_task(post({"prompt": "Q: Hi?", "echo": True, "logprobs": 1,
                                           "max_tokens": 0}))
        while not server.queue:
            await asyncio.sleep(0.01)
        queued.set()
        return await asyncio.wait_for(scored, timeout=30), await asyncio.wait_for(long, timeout=30)

    (status, scored), (long_status, failed) = asyncio.run(_serving(_config(tmp_path), work))
    assert status == 200 and scored["choices"][0]["text"] == "Q: Hi?"
    assert len(scored["choices"][0]["logprobs"]["tokens"]) == len("Q: Hi?")
    assert long_status == 500 and "the device went away" in failed["error"]["message"]


def test_a_scored_prompt_prefilled_before_another_prompts_failed_prefill_is_still_answered(
        tmp_path: Path) -> None:
    """Two groups join in one iteration: a scored prompt (echo, max_tokens 0), answered as its
    prefill ends, and a plain one whose prefill then fails. The scored answer was computed: it is
    delivered, not failed with the plain prompt's error."""
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path)

    async def check() -> tuple[object, BaseException | None]:
        model, _ = serve.load_model(cfg)
        server = serve.Server(cfg, model)
        real = model.forward_step

        def failing(tokens, cache, last_only=False):  # type: ignore[no-untyped-def]
            if last_only and tokens.shape[1] > 1:  # the plain prompt's prefill (the scored one's is whole)
                raise RuntimeError("the device went away")
            return real(tokens, cache, last_only=last_only)

        model.forward_step = failing
        scored = serve.Request([5, 6, 7, 8], 0, 0.0, 0, echo=True, logprobs=1)
        plain = serve.Request([9, 10, 11, 12, 13], 4, 0.0, 0)
        server.queue = [scored, plain]
        batching = asyncio.create_task(server.run_batches())
        server.wake.set()
        try:
            answer = await asyncio.wait_for(scored.done, timeout=30)
            failure = None
            try:
                await asyncio.wait_for(plain.done, timeout=30)
            except RuntimeError as error:
                failure = error
            return answer, failure
        finally:
            batching.cancel()

    answer, failure = asyncio.run(check())
    assert isinstance(answer, tuple) and answer[1] == 0  # answered, no token decoded
    assert failure is not None and "the device went away" in str(failure)


def test_echo_is_refused_where_it_cannot_be_served(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    hi = {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 2}
    cases = [("/v1/chat/completions", {**hi, "echo": True}, "echo"),
             ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
             ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens")]

    async def work(session, server, report):
        answers = []
        for path, body, _ in cases:
            async with session.post(path, json=body) as r:
                answers.append((r.status, (await r.json())["error"]["message"]))
        return answers

    for (status, error), (_, _, field) in zip(asyncio.run(_serving(_config(tmp_path), work)), cases,
                                               strict=True):
        assert status == 400 and error.split(":")[0] == field, error
    assert "0 only with echo" in error


def test_logprobs_requests_out_of_range_are_refused_naming_the_field(tmp_path: Path) -> None:
    _saved_model(tmp_path / "ckpt")
    hi = {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 2}
    cases = [("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
             ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
             ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
             ("/v1/chat/completions", {**hi, "top_logprobs": 2}, "top_logprobs"),
             ("/v1/chat/completions", {**hi, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ("/v1/chat/completions", {**hi, "logprobs": "yes"}, "logprobs")]

    async def work(session, server, report):
        answers = []
        for path, body, _ in cases:
            async with session.post(path, json=body) as r:
                answers.append((r.status, (await r.json())["error"]["message"]))
        unasked = {"prompt": "x", "max_tokens": 2, "logprobs": False}
        async with session.post("/v1/completions", json=unasked) as r:
            answers.append((r.status, (await r.json())["choices"][0]["logprobs"]))
        return answers

    answers = asyncio.run(_serving(_config(tmp_path), work))
    for (status, error), (_, _, field) in zip(answers, cases, strict=False):
        assert status == 400 and error.split(":")[0] == field, error
    assert answers[-1] == (200, None)  # false, as some clients send: none asked


def test_completion_logprobs_show_partial_characters_as_bytes_and_offsets_by_character() -> None:
    entries = [serve.logprobs.TokenLogprob(t, -0.5, ((t, -0.5),)) for t in "é a".encode()]
    shaped = serve.logprobs.completion_logprobs(entries)
    assert shaped["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", " ", "a"]
    assert shaped["text_offset"] == [0, 0, 1, 2]  # é is one character of two bytes
    assert serve.logprobs.text_offsets(entries, 10) == [10, 10, 11, 12]
    chat_shaped = serve.logprobs.chat_logprobs(entries[:1])
    assert chat_shaped["content"][0]["bytes"] == [0xC3]


def test_requests_of_a_prefill_whose_seating_fails_partway_are_all_cleared_once(tmp_path: Path) -> None:
    """Seating a whole prefill's requests in rows failed after the first: the others were in
    neither the rows nor the prefills, `clear` missed them, and their answers never came."""
    model = _saved_model(tmp_path / "ckpt")

    async def run() -> tuple[list, list]:
        batch = continuous_batching.RunningBatch(model, prefix_cache.PrefixCache(0), 64, max_rows=4)
        requests = [continuous_batching.Request([1, 2, 3], 2, 0.0, i) for i in range(3)]  # one group
        batch.admit(requests)
        assert batch.cache is not None
        place, calls = batch.cache.place, []

        def failing(*args: object) -> None:
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("the device went away")
            place(*args)

        batch.cache.place = failing  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="went away"):
            batch.prefill()
        return requests, batch.clear()

    requests, cleared = asyncio.run(run())
    assert sorted(map(id, cleared)) == sorted(map(id, requests))


def test_rows_sampled_together_draw_what_each_draws_alone() -> None:
    """The batch's sampled rows share one softmax and one nucleus pass: each row's token is the
    one its own temperature, top_p and seed give it alone, whatever its neighbours ask."""
    torch.manual_seed(1)
    logits = torch.randn(4, 256) * 3
    settings = [(1.0, 1.0, 5), (0.7, 0.9, 6), (1e-6, 1.0, 7), (2.0, 0.3, 8)]

    async def requests() -> list:
        return [continuous_batching.Request([1], 4, t, seed, top_p=p) for t, p, seed in settings]

    batch = asyncio.run(requests())
    for draw in range(3):  # the generators move on together
        generators = [torch.Generator().manual_seed(seed * 100 + draw) for _, _, seed in settings]
        together = continuous_batching.sample(logits, batch, generators)
        alone = []
        for row, (t, p, seed) in enumerate(settings):
            probs = torch.softmax((logits[row] - logits[row].max()) / t, dim=-1)
            if p < 1:
                probs = continuous_batching.nucleus(probs, p)
            generator = torch.Generator().manual_seed(seed * 100 + draw)
            alone.append(int(torch.multinomial(probs, 1, generator=generator)))
        assert together == alone
    assert together[2] == int(logits[2].argmax())  # a tiny temperature is greedy


@pytest.mark.parametrize("temperature", [1e-45, 1e-46, 5e-324])
def test_a_temperature_below_float32s_range_is_greedy_and_fails_no_row(temperature: float) -> None:
    """Below about 7e-46 a temperature was 0 in the float32 tensor, the best logit's 0 / 0 a
    NaN, and multinomial's error failed every request of the batch: any client could send it."""
    torch.manual_seed(2)
    logits = torch.randn(2, 256) * 3

    async def requests() -> list:
        return [continuous_batching.Request([1], 4, t, 3) for t in (temperature, 1.0)]

    generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
    drawn = continuous_batching.sample(logits, asyncio.run(requests()), generators)
    assert drawn[0] == int(logits[0].argmax())
    model = models.build_model(run_config.build_model_config(training.ModelSpec.model_validate(ARCHITECTURE)))
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(prompt, 3, temperature=temperature), model.generate(prompt, 3))


def test_nucleus_keeps_the_most_likely_tokens_whose_mass_first_reaches_top_p() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    assert continuous_batching.nucleus(probs, 0.7).tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])
    assert continuous_batching.nucleus(probs, 0.8).tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])
    assert continuous_batching.nucleus(probs, 0.81).tolist() == pytest.approx([0.15, 0.5, 0.0, 0.3])
    assert continuous_batching.nucleus(probs, 0.0).tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0])


def test_n_choices_are_the_answers_of_consecutive_seeds_and_top_p_narrows_sampling(tmp_path: Path) -> None:
    """`n` choices (OpenAI's field) are decoded side by side from one prefill: choice i is what
    one request with seed + i answers, streamed or not; usage counts the prompt once. A tiny
    `top_p` leaves only the most likely token, so sampling at temperature 1 answers greedily."""
    model = _saved_model(tmp_path / "ckpt")
    prompt = "Q: What is 1 + 2?\nA:"
    ask = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 5}

    async def work(session, server, report):
        async def post(body: dict) -> tuple[int, object]:
            async with session.post("/v1/completions", json=body) as r:
                return r.status, (await r.json() if not body.get("stream") else await r.text())

        _, three = await post({**ask, "n": 3})
        async with session.get("/metrics") as r:
            prefilled = _metric(await r.text(), 'huorn_serve_prompt_tokens_total{source="prefill"}')
        alone = [(await post({**ask, "seed": 5 + i}))[1] for i in range(3)]
        _, streamed = await post({**ask, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
        _, nucleus = await post({**ask, "top_p": 1e-9})
        refused = [await post({**ask, **bad}) for bad in (
            {"n": 0}, {"n": 9}, {"top_p": 1.5}, {"best_of": 2}, {"echo": "yes"}, {"presence_penalty": 0.5},
            {"seed": 2**64}, {"seed": 2**64 - 2, "n": 3},
            {"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": {"usage": 1}},
            {"tools": [{"type": "function", "function": {"name": "add"}}]}, {"top_k": 40})]
        # what SDKs send when the caller sets nothing is not refused
        unset = {"logprobs": None, "echo": False, "presence_penalty": 0, "best_of": 1, "tools": None,
                 "response_format": {"type": "text"}, "top_k": -1}
        _, defaults = await post({**ask, **unset})
        return three, prefilled, alone, streamed, nucleus, refused, defaults

    run = asyncio.run(_serving(_config(tmp_path), work))
    three, prefilled, alone, streamed, nucleus, refused, defaults = run
    texts = [c["text"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts == [a["text"] for a in alone] and len(set(texts)) > 1
    assert three["usage"]["prompt_tokens"] == len(prompt) and three["usage"]["completion_tokens"] == 18
    assert prefilled == len(prompt)  # one prefill for the three rows
    events = _sse_events(streamed)
    *events, usage = events  # include_usage: a last chunk with no choice, the whole request's usage
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(prompt)
    assert (usage["usage"]["completion_tokens"], usage["usage"]["total_tokens"]) == (12, len(prompt) + 12)
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert "".join(e["choices"][0]["text"] for e in mine) == texts[index]
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
        assert "usage" not in mine[-1]  # a choice's own count is not the request's
    ids = torch.tensor([list(prompt.encode())])
    greedy = model.generate(ids, 6)[0, ids.shape[1]:].tolist()
    assert nucleus["text"] == bytes(greedy).decode("utf-8", errors="replace")
    assert [status for status, _ in refused] == [400] * 12
    refused = [(status, json.loads(body) if isinstance(body, str) else body) for status, body in refused]
    # OpenAI's error object: the field in `param`, which clients show beside the message
    assert [body["error"]["param"] for _, body in refused] == [
        "n", "n", "top_p", "best_of", "echo", "presence_penalty", "seed", "seed", "stream_options",
        "stream_options", "tools", "top_k"]
    assert {body["error"]["type"] for _, body in refused} == {"invalid_request_error"}
    assert "spec.serving.maxBatch" in refused[1][1]["error"]["message"]
    assert "not served by this replica" in refused[3][1]["error"]["message"]
    assert defaults["text"] == alone[0]["text"]


def test_with_include_usage_only_the_usage_chunk_carries_the_requests_usage(tmp_path: Path) -> None:
    """stream_options.include_usage with one choice: the usage chunk is the one chunk with usage,
    as OpenAI sends it (clients that add up the usage of every chunk, as LangChain's streamed
    messages do, counted the request twice when the choice's last chunk carried it too); without
    it, that last chunk keeps the request's usage."""
    _saved_model(tmp_path / "ckpt")
    completion = {"prompt": "Q: Hi?\nA:", "max_tokens": 4, "stream": True}
    conversation = {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 4, "stream": True}
    usage = {"stream_options": {"include_usage": True}}

    async def work(session, server, report):
        streams = []
        for path, body in (("/v1/completions", {**completion, **usage}),
                           ("/v1/chat/completions", {**conversation, **usage}),
                           ("/v1/completions", completion)):
            async with session.post(path, json=body) as r:
                text = await r.text()
            streams.append(_sse_events(text))
        return streams

    *asked, unasked = asyncio.run(_serving(_config(tmp_path), work))
    for events in asked:
        with_usage = [e for e in events if e.get("usage") is not None]
        assert with_usage == [events[-1]] and events[-1]["choices"] == []
        assert events[-1]["usage"]["completion_tokens"] == 4
    assert [e for e in unasked if e.get("usage") is not None] == [unasked[-1]]
    assert unasked[-1]["choices"][0]["finish_reason"] == "length"
    assert unasked[-1]["usage"]["completion_tokens"] == 4


def test_a_forward_pass_that_fails_after_a_row_ended_still_answers_that_row(tmp_path: Path) -> None:
    """A step answers the rows that end, then feeds the others: a device error in that forward
    pass fails the rows still decoding, and the answer already made reaches its client (it was
    lost before: its client waited for ever)."""
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path)

    async def check() -> tuple[object, BaseException | None]:
        model, _ = serve.load_model(cfg)
        server = serve.Server(cfg, model)

        def feed() -> None:
            raise RuntimeError("device lost")

        server.running.feed = feed
        short, long = serve.Request(list(b"Q: 1?"), 1, 0.0, 0), serve.Request(list(b"Q: 22?"), 5, 0.0, 0)
        server.queue = [short, long]
        batcher = asyncio.create_task(server.run_batches())
        server.wake.set()
        try:
            answered = await asyncio.wait_for(short.done, 30)
            failed = await asyncio.wait_for(asyncio.gather(long.done, return_exceptions=True), 30)
        finally:
            batcher.cancel()
        return answered, failed[0]

    answered, failed = asyncio.run(check())
    assert answered[1] == 1 and isinstance(failed, RuntimeError) and "device lost" in str(failed)


def test_a_failed_step_ends_only_the_streams_of_the_rows_it_failed(tmp_path: Path) -> None:
    """A streamed request of n = 2 whose choice 0 got the last free row and ended (its one token)
    in a step whose forward pass then failed: choice 0 had its end already, and the failure must
    not end it again, or the client's stream closed before choice 1 (still queued, decoded next)
    sent a byte of its text."""
    model = _saved_model(tmp_path / "ckpt", ascii_only=True)
    cfg = _config(tmp_path, serving={"maxBatch": 2, "maxTokens": 48})
    prompt = "Q: 1?\nA:"

    async def work(session, server, report):
        real_admit, real_feed = server.running.admit, server.running.feed
        entered, gate, failed = asyncio.Event(), threading.Event(), []
        loop = asyncio.get_running_loop()

        def admit(admitted):
            if admitted and admitted[0].tokens == [ord("Q")]:  # holds the batcher until all are queued
                loop.call_soon_threadsafe(entered.set)
                gate.wait(60)
            return real_admit(admitted)

        def feed() -> None:
            if server.running.rows and not failed:  # the step that answered choice 0
                failed.append(1)
                raise RuntimeError("device lost")
            real_feed()

        server.running.admit, server.running.feed = admit, feed

        async def post(body: dict) -> tuple[int, str]:
            async with session.post("/v1/completions", json=body) as r:
                return r.status, await r.text()

        held = asyncio.create_task(post({"temperature": 0, "prompt": "Q", "max_tokens": 1}))
        await asyncio.wait_for(entered.wait(), 60)
        long = asyncio.create_task(post({"temperature": 0, "prompt": "Q: 22?\nA:", "max_tokens": 20}))
        while len(server.queue) < 1:
            await asyncio.sleep(0.01)
        streamed = asyncio.create_task(post({"temperature": 0, "prompt": prompt, "max_tokens": 1, "n": 2,
                                             "stream": True}))
        while len(server.queue) < 3:  # the long one and choice 0 fill both rows; choice 1 waits
            await asyncio.sleep(0.01)
        gate.set()
        await held
        return (await long)[0], await asyncio.wait_for(streamed, 60)

    long_status, (status, text) = asyncio.run(_serving(cfg, work))
    assert long_status == 500 and status == 200
    events = _sse_events(text)
    ids = torch.tensor([list(prompt.encode())])
    expected = bytes(model.generate(ids, 1)[0, ids.shape[1]:].tolist()).decode()
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert "".join(e["choices"][0]["text"] for e in mine) == expected
        assert mine[-1]["done"] is True


@pytest.mark.parametrize("chunk", [8, 0])
def test_a_long_prompt_joining_is_prefilled_a_chunk_a_step_and_answers_stay_exact(
        tmp_path: Path, chunk: int) -> None:
    """Chunked prefill: a 40-token prompt joining a running answer is prefilled 8 tokens before
    each decoding step, so the running answer gains a token between its chunks instead of waiting
    for the whole prefill (chunk 0); both answers equal each one's greedy decoding alone."""
    model = _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path, serving={"maxBatch": 8, "maxTokens": 64, "prefillChunkTokens": chunk})
    running_prompt, joining_prompt = list(b"Q: 1?\nA:"), list(b"Q: what is the sum of 12 and 30?\nA: ok, ")

    async def run() -> tuple[list[int], list[object]]:
        loaded, _ = serve.load_model(cfg)
        server = serve.Server(cfg, loaded)
        batch, widths, forward = server.running, [], loaded.forward_step

        def counted(tokens, cache, **kwargs):
            widths.append(tokens.shape[1])
            return forward(tokens, cache, **kwargs)

        loaded.forward_step = counted
        first, second = serve.Request(running_prompt, 20, 0.0, 0), serve.Request(joining_prompt, 5, 0.0, 0)
        results: dict[int, object] = {}
        batch.admit([first])
        for step in range(40):
            if step == 3:
                widths.clear()
                batch.admit([second])
            batch.prefill(cfg.spec.serving.prefill_chunk_tokens)
            if len(batch):
                answered = batch.step()
                results.update({id(r): result for r, result in answered})
                batch.feed()
        return widths, [results[id(first)], results[id(second)]]

    widths, (first, second) = asyncio.run(run())
    assert len(joining_prompt) == 40
    if chunk:
        assert widths[:10] == [8, 1, 8, 1, 8, 1, 8, 1, 8, 1]  # a chunk, then the running row's step
    else:
        assert widths[:2] == [40, 1]
    for prompt, (text, count, *_), tokens in ((running_prompt, first, 20), (joining_prompt, second, 5)):
        ids = torch.tensor([prompt])
        assert count == tokens
        assert text == bytes(model.generate(ids, tokens)[0, len(prompt):].tolist()).decode("utf-8", "replace")


def test_the_defaults_sample_as_openais_do_and_a_seed_repeats_an_answer(tmp_path: Path) -> None:
    """OpenAI's temperature defaults to 1, and an unseeded request draws afresh: greedy with seed
    0 had made `n` choices, and every "regenerate" of a chat UI, the same answer."""
    _saved_model(tmp_path / "ckpt")
    ask = {"prompt": "Q: What is 1 + 2?\nA:", "max_tokens": 12}

    async def work(session, server, report):
        async def post(body: dict) -> dict:
            async with session.post("/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        unseeded = [await post({**ask, "n": 4})]
        unseeded += [await post(ask) for _ in range(3)]
        seeded = [await post({**ask, "seed": 11}) for _ in range(2)]
        return unseeded, seeded

    unseeded, seeded = asyncio.run(_serving(_config(tmp_path), work))
    choices = [c["text"] for c in unseeded[0]["choices"]]
    assert len(set(choices)) > 1, choices  # 4 choices of 12 tokens from 256 bytes: never all equal
    assert len({answer["text"] for answer in unseeded[1:]} | {choices[0]}) > 1
    assert seeded[0]["text"] == seeded[1]["text"]



def test_in_flight_counts_the_batch_rows_a_request_fills(tmp_path: Path) -> None:
    """The autoscaler divides huorn_serve_in_flight by maxBatch rows: a request of four choices
    of two prompts fills eight rows, and counted as one it read a full replica as nearly idle
    (found by review)."""
    _saved_model(tmp_path / "ckpt")
    release = threading.Event()

    async def work(session, server, report):
        step = server.running.step

        def held() -> object:
            release.wait(timeout=30)
            return step()

        server.running.step = held
        body = {"prompt": ["Q: 1?\nA:", "Q: 2?\nA:"], "n": 4, "max_tokens": 2}
        answer = asyncio.ensure_future(session.post("/v1/completions", json=body))
        rows = 0.0
        for _ in range(200):
            async with session.get("/metrics") as r:
                rows = _metric(await r.text(), "huorn_serve_in_flight")
            if rows:
                break
            await asyncio.sleep(0.05)
        release.set()
        async with await answer as r:
            status = r.status
        return rows, status

    rows, status = asyncio.run(_serving(_config(tmp_path), work))
    assert (rows, status) == (8.0, 200)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_a_replica_told_to_serve_on_cuda_refuses_a_torch_without_it(tmp_path: Path) -> None:
    """Checked before the slow model load, with the fix in the message."""
    _saved_model(tmp_path / "ckpt")
    cfg = serve.ServeConfig.model_validate({**_config(tmp_path).model_dump(by_alias=True), "device": "cuda"})
    with pytest.raises(ValueError, match=r"device cuda: .*CUDA build"):
        serve.load_model(cfg)


def test_a_request_past_a_full_queue_is_answered_429_with_retry_after_and_counted(tmp_path: Path) -> None:
    """Under overload a replica's queue only grew, and every client timed out in it; now a
    request that would queue past spec.serving.maxQueued rows is refused at once, in OpenAI's
    shape, with a Retry-After that the SDKs honour, and one finding the queue empty is taken."""
    _saved_model(tmp_path / "ckpt")
    cfg = _config(tmp_path, serving={"maxBatch": 8, "maxTokens": 48, "maxQueued": 3})

    async def work(session, server, report):
        # rows already waiting (the decoding thread is not told: they stay queued)
        with server.queue_lock:
            server.queue.extend([object()] * 2)  # type: ignore[list-item]
        # queued behind them, it would wait for ever (the decoding thread cannot take them)
        async with session.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2},
                                timeout=aiohttp.ClientTimeout(total=10)) as r:
            refused = r.status, r.headers.get("Retry-After"), await r.json()
        with server.queue_lock:
            server.queue.clear()
        async with session.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "n": 5}) as r:
            taken = r.status  # more rows than the bound, into an empty queue
        async with session.get("/metrics") as r:
            return refused, taken, await r.text()

    (status, retry, body), taken, metrics = asyncio.run(_serving(cfg, work))
    assert status == 429 and retry == "1"
    assert body["error"]["code"] == "rate_limit_exceeded" and "maxQueued 3" in body["error"]["message"]
    assert body["error"]["type"] == "rate_limit_exceeded"  # a client retries it, unlike an invalid request
    assert taken == 200
    assert 'huorn_serve_requests_total{outcome="overloaded"} 1.0' in metrics
    assert "huorn_serve_in_flight 0.0" in metrics
