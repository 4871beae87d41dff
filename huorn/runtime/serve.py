"""The serving runtime of an InferenceJob replica: one model (GLVQ-quantised when the spec says so)
behind an HTTP API, with requests batched and Prometheus metrics.

    python -m huorn.runtime.serve --config serve-config.json

- `POST /v1/completions` {"prompt": str, "max_tokens": int, "temperature": float, "seed": int,
  "stop": str | [str], "stream": bool}
  → {"text", "tokens", "cached_tokens", "queue_seconds", "seconds"}. Prompts are byte-tokenised,
  as in training; `cached_tokens` counts the prompt's tokens whose K/V the prefix cache gave.
- The answers also carry OpenAI's completions fields (`id`, `object`, `created`, `model`,
  `choices`, `usage` with `prompt_tokens_details.cached_tokens`), so OpenAI and vLLM clients read
  them; a request's `model`, when given, must be the job's name (`GET /v1/models`), else 404.
- `GET /healthz` is 200 once the model is loaded (a readiness probe), `GET /metrics` the
  Prometheus text: requests, generated tokens, seconds spent decoding (the busy fraction the
  operator's autoscaler reads), latency and batch-size histograms.

Batching: requests wait in one queue; the model takes the oldest and, with it, every waiting
request of the same prompt length, up to `serving.maxBatch`, and decodes them together with one
KV cache (the decoder has no padding mask, so only equal lengths share a batch). Each prompt of a
batch skips the prefill of its leading blocks held in the prefix cache
(`huorn.runtime.prefix_cache`, `serving.prefixCacheTokens`), and the batch keeps its prompts'
blocks there for the next ones, and the blocks its answers complete (a conversation's next turn
carries them). Generation
runs in a worker thread, so the server keeps accepting while it decodes. A request asking for
more than `serving.maxTokens` tokens in all, or past the model's context, is refused with 400
naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import math
import signal
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import prometheus_client
import torch
from aiohttp import web
from pydantic import Field

from huorn import models
from huorn.api import base, inference, training
from huorn.models.cache import KVCache
from huorn.runtime import chat, checkpoint, glvq, prefix_cache
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler, tokenizer

CALIBRATION_SOURCES = ("general", "code", "math")
CHAT_DEFAULT_TOKENS = 256  # a chat answer's cap when the request gives none
BATCHER = web.AppKey("batcher", asyncio.Task)


class ServeConfig(base.ApiModel):
    job_name: str = Field(min_length=1)
    spec: inference.InferenceJobSpec
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535, description="0 picks a free port (written to run_dir).")
    run_dir: Path = Field(description="Where the bound port and the load report are written.")
    data_dir: Path | None = Field(default=None, description="Corpora for GLVQ's calibration.")
    calibration_batches: int = Field(default=8, ge=1, le=1024, description="GLVQ's calibration batches "
                                     "of 4 sequences from the shipped corpora.")
    quantize_steps: int = Field(default=200, ge=0, le=100_000, description="GLVQ's Adam steps per layer.")
    device: str = Field(default="auto", pattern="^(auto|cpu|cuda)$")


def load_model(cfg: ServeConfig) -> tuple[torch.nn.Module, dict]:
    """The checkpoint in spec.model.checkpoint with spec.model.architecture, quantised as
    spec.quantization says; returns the model and what loading did."""
    spec = cfg.spec
    path = checkpoint.resolve(Path(spec.model.checkpoint))
    meta = checkpoint.read_meta(path)
    architecture = spec.model.architecture
    if meta.get("model") is not None and training.ModelSpec.model_validate(meta["model"]) != architecture:
        raise ValueError(f"spec.model.architecture: {path} holds another architecture ({meta['model']}); "
                         "set spec.model.architecture to it")
    model = models.build_model(run_config.build_model_config(architecture))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint.load_checkpoint(path, model, None)
    model.eval()
    report: dict = {"checkpoint": str(path), "step": meta.get("step"),
                    "quantization": spec.quantization.method}
    q = spec.quantization
    if q.method == "glvq":
        assert q.bits is not None  # the quantization-glvq-bits rule
        mixture = sampler.build_mixture([(s, 1.0, None) for s in CALIBRATION_SOURCES], 0,
                                        architecture.context, cfg.data_dir)
        batches = [mixture.micro_batch(10**9 + i, 0, 4)[0] for i in range(cfg.calibration_batches)]
        started = time.monotonic()
        quantized = glvq.quantize_model(model, batches, q.bits, q.group_size, steps=cfg.quantize_steps)
        report |= {"bits": q.bits, "bits_per_weight": quantized["bits_per_weight"],
                   "quantize_seconds": time.monotonic() - started}
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    return model.to(device), report


def save_untrained(root: Path, architecture: training.ModelSpec, seed: int = 0) -> Path:
    """A freshly initialised model as a servable checkpoint: load tests and benchmarks measure
    what serving costs, not what it answers, and need no training run first."""
    torch.manual_seed(seed)
    model = models.build_model(run_config.build_model_config(architecture))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return checkpoint.save_checkpoint(root, 1, model, torch.optim.AdamW(model.parameters()),
                                          {"model": architecture.to_wire()}, rank=0, barrier=lambda: None)


@dataclass
class Request:
    tokens: list[int]
    max_tokens: int
    temperature: float
    seed: int
    arrived: float = field(default_factory=time.monotonic)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # With "stream": its tokens as they are chosen, then None; filled from the decoding thread.
    stream: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    first_token_at: float | None = None  # when its batch chose its first token
    stop: tuple[bytes, ...] = ()  # the answer ends before the first of these it would contain
    finish_reason: str | None = None  # "stop" or "length", once decoded
    chat: bool = False  # asked through the chat API: answered in its shape
    # Its client went (a streamed answer's connection closed): the batch stops choosing its tokens.
    abandoned: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Answer:
    """One row's answer as it is decoded: where it ends, and how much of it a stream has been
    sent. A stream holds back only the newest bytes that may yet turn out to begin a stop
    sequence; the others reach the client as they are chosen."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    finished: str | None = None
    streamed: int = 0

    def add(self, token: int) -> None:
        if self.request.abandoned:  # nobody reads the rest: the batch may stop sooner
            self.finished = self.finished or "abandoned"
        if self.finished:
            return
        self.tokens.append(token)
        # every match ends at the newest byte (an earlier one would have ended the answer), so the
        # longest starts first: the answer ends before it, whatever the order the stops came in
        matched = [len(s) for s in self.request.stop if bytes(self.tokens[-len(s):]) == s]
        if matched:
            del self.tokens[-max(matched):]
            self.finished = "stop"
        elif len(self.tokens) >= self.request.max_tokens:
            self.finished = "length"
        self.flush()

    def pending(self) -> int:
        """How many of the newest bytes begin some stop sequence: a chat's stops are 8 bytes, and a
        stream that held back that many regardless would reach its client 7 tokens late."""
        stops = self.request.stop
        for n in range(min(len(self.tokens), max((len(s) for s in stops), default=1) - 1), 0, -1):
            tail = bytes(self.tokens[-n:])
            if any(stop.startswith(tail) for stop in stops):
                return n
        return 0

    def flush(self) -> None:
        request = self.request
        if request.stream is None:
            return
        end = len(self.tokens) - (0 if self.finished else self.pending())
        for token in self.tokens[self.streamed: end]:
            request.loop.call_soon_threadsafe(request.stream.put_nowait, token)
        self.streamed = max(self.streamed, end)


def read_number(body: dict, name: str, kind: type[int] | type[float], default: float) -> Any:
    """A numeric field, its default when absent or null (as OpenAI reads null); ValueError naming
    it otherwise (int() would take "12", 1.5 or true and say nothing of which field was wrong)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise ValueError(f"{name}: give {'an integer' if kind is int else 'a number'}, not {value!r}")
    return kind(value)


def stream_error(message: str) -> dict:
    """An error event in OpenAI's shape: the openai SDK raises it with `error.message`, and with
    the plain string of an HTTP error body it would say only "An error occurred during streaming"."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def sse(event: dict) -> bytes:
    """One server-sent event: a client reads `data:` lines until `data: [DONE]`."""
    return f"data: {json.dumps(event)}\n\n".encode()


class Metrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter("huorn_serve_requests", "Completions answered, by outcome.",
                                                  ["outcome"], registry=self.registry)
        self.tokens = prometheus_client.Counter("huorn_serve_generated_tokens", "Tokens generated.",
                                                registry=self.registry)
        self.latency = prometheus_client.Histogram(
            "huorn_serve_request_seconds", "Arrival to answer.", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        # Seconds spent decoding: its rate is the replica's busy fraction, the utilisation that the
        # operator's autoscaler targets (huorn.scheduler.autoscale).
        self.busy = prometheus_client.Counter("huorn_serve_busy_seconds", "Seconds spent decoding batches.",
                                              registry=self.registry)
        # Accepted and not yet answered: what the autoscaler reads when answers stop coming (a
        # replica so overloaded that nothing completes would otherwise look idle).
        self.in_flight = prometheus_client.Gauge("huorn_serve_in_flight", "Requests accepted, not yet "
                                                 "answered.", registry=self.registry)
        # Prompt tokens by where their K/V came from: the prefix cache's hit rate, and what a
        # prefix router (huorn.runtime.router) buys.
        self.prompt_tokens = prometheus_client.Counter(
            "huorn_serve_prompt_tokens", "Prompt tokens, by source of their K/V (cache or prefill).",
            ["source"], registry=self.registry)
        self.prefix_cache_bytes = prometheus_client.Gauge(
            "huorn_serve_prefix_cache_bytes",
            "Bytes of K/V the prefix cache holds (serving.prefixCacheTokens bounds it).",
            registry=self.registry)
        self.prefix_evictions = prometheus_client.Counter(
            "huorn_serve_prefix_cache_evicted_blocks", "Blocks of 16 tokens evicted from the prefix cache.",
            registry=self.registry)
        self.first_token = prometheus_client.Histogram(
            "huorn_serve_time_to_first_token_seconds", "Arrival to the first token chosen: queueing and "
            "prefill, what a streaming client waits before it reads anything.", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.batch = prometheus_client.Histogram(
            "huorn_serve_batch_size", "Requests decoded together.", registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128))


class Server:
    def __init__(self, cfg: ServeConfig, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.model = model
        self.limits = cfg.spec.serving
        self.context = cfg.spec.model.architecture.context
        self.queue: list[Request] = []
        self.wake = asyncio.Event()
        self.metrics = Metrics()
        self.prefixes = prefix_cache.PrefixCache(self.limits.prefix_cache_tokens)
        self.started = int(time.time())
        self.stopping = False  # handlers cancelled as the server stops are not abandoned

    # -- HTTP ------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's chat API: the messages rendered by the chat template (huorn.runtime.chat),
        the answer ended where the model would write the next turn."""
        return await self.complete(request, is_chat=True)

    async def complete(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body: give a JSON object of the request's fields")
            if is_chat:
                prompt = chat.render(body.get("messages"))
            else:
                prompt = body["prompt"]
                if not isinstance(prompt, str) or not prompt:
                    raise ValueError("prompt: give a non-empty string")
            tokens = list(prompt.encode("utf-8"))
            limit = min(self.limits.max_tokens, self.context)
            # OpenAI's chat API has no default cap (an answer runs to its end-of-turn token or the
            # context, and SDKs send none) and names it max_completion_tokens now; its completions
            # API's is 16. These models have no end-of-turn token (an answer ends at a stop, which
            # an untrained or plain-text model may never write): a chat with no cap gets
            # CHAT_DEFAULT_TOKENS, or what fits, rather than the whole context every time
            name = "max_completion_tokens" if is_chat and body.get("max_completion_tokens") is not None \
                else "max_tokens"
            fits = max(1, limit - len(tokens))
            wanted = read_number(body, name, int, min(CHAT_DEFAULT_TOKENS, fits) if is_chat else 16)
            temperature = read_number(body, "temperature", float, 0.0)
            seed = read_number(body, "seed", int, 0)
            model = body.get("model")
            if model is not None and model != self.cfg.job_name:
                self.metrics.requests.labels("refused").inc()
                message = (f"model: this replica serves {self.cfg.job_name!r} (its InferenceJob's name), "
                           f"not {model!r}; GET /v1/models lists it")
                return web.json_response({"error": message}, status=404)
            stop = body.get("stop")
            stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
            if not isinstance(stops, list) or len(stops) > 4 or \
                    not all(isinstance(x, str) and 0 < len(x.encode()) <= 64 for x in stops):
                raise ValueError("stop: give a string or a list of up to 4, each of 1-64 bytes")
            stream = body.get("stream")
            stream = False if stream is None else stream  # null is the default, as OpenAI reads it
            if not isinstance(stream, bool):
                raise ValueError("stream: give true (server-sent events, a token at a time) or false")
            if wanted < 1:
                raise ValueError(f"{name}: give 1 or more")
            if not 0 <= temperature < math.inf:  # NaN too: it fails its whole batch
                raise ValueError("temperature: give a finite number ≥ 0")
            if len(tokens) + wanted > limit:
                raise ValueError(f"{name}: prompt ({len(tokens)} tokens) + {name} ({wanted}) exceeds "
                                 f"{limit} (spec.serving.maxTokens and the model's context); ask for fewer")
        except (KeyError, ValueError, TypeError, OverflowError, json.JSONDecodeError) as error:
            self.metrics.requests.labels("refused").inc()
            message = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            return web.json_response({"error": message}, status=400)
        stops += [s for s in chat.STOPS if is_chat and s not in stops]
        item = Request(tokens, wanted, temperature, seed, stream=asyncio.Queue() if stream else None,
                       stop=tuple(x.encode() for x in stops), chat=is_chat)
        self.queue.append(item)
        self.wake.set()
        self.metrics.in_flight.inc()
        try:
            if item.stream is not None:
                return await self.stream_answer(request, item)
            try:
                text, count, cached, queued, seconds = await item.done
            except asyncio.CancelledError:
                # the client hung up (its time-out, then a retry: under load, the decode it
                # abandons is what the retry waits behind); run_until_signal's runner cancels
                # the handler of a closed connection
                if not self.stopping:
                    self.abandon(item)
                raise
            except Exception as error:  # the batch failed: this request is answered, and counted
                self.metrics.requests.labels("failed").inc()
                return web.json_response({"error": f"generation failed: {error!r}"}, status=500)
        finally:
            self.metrics.in_flight.dec()
        self.answered(item)
        return web.json_response({**self.openai_fields(item, text, count, cached), "text": text,
                                  "tokens": count, "cached_tokens": cached, "queue_seconds": queued,
                                  "seconds": seconds})

    def openai_fields(self, item: Request, text: str, count: int | None = None,
                      cached: int | None = None, first: bool = True) -> dict:
        """The answer as OpenAI's completions API shapes it, beside Huorn's own fields, so the
        clients and SDKs written for it (and for vLLM, which follows it) read it unchanged.

        A stream's role comes in its `first` chunk only: the openai SDK joins a stream's deltas
        field by field, and a role in every chunk came out "assistantassistant..."."""
        finish = item.finish_reason if count is not None else None
        if item.chat:
            chunk = item.stream is not None
            message = {"role": "assistant", "content": text} if first else {"content": text}
            content = {"delta" if chunk else "message": message}
            fields: dict = {"id": f"chat{item.id}", "object": "chat.completion.chunk" if chunk else
                            "chat.completion", "created": item.created, "model": self.cfg.job_name,
                            "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": finish}]}
        else:
            fields = {"id": item.id, "object": "text_completion", "created": item.created,
                      "model": self.cfg.job_name,
                      "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        if count is not None:
            fields["usage"] = {"prompt_tokens": len(item.tokens), "completion_tokens": count,
                               "total_tokens": len(item.tokens) + count,
                               "prompt_tokens_details": {"cached_tokens": cached}}
        return fields

    def answered(self, item: Request) -> None:
        self.metrics.requests.labels("ok").inc()
        self.metrics.latency.observe(time.monotonic() - item.arrived)
        if item.first_token_at is not None:
            self.metrics.first_token.observe(item.first_token_at - item.arrived)

    async def stream_answer(self, request: web.Request, item: Request) -> web.StreamResponse:
        """Server-sent events: {"text"} as the tokens come (bytes held back until they complete a
        UTF-8 character), then {"done", "tokens", "cached_tokens", "queue_seconds", "seconds"}
        or {"error"}, then [DONE]."""
        assert item.stream is not None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await self.send_events(request, response, item)
        except ConnectionResetError:
            # the client hung up (a chat UI's stop button): the rest of its answer is decoded for
            # no one, and a traceback per hang-up would be noise
            self.abandon(item)
        except asyncio.CancelledError:  # the same, seen while it waited for its next token
            if not self.stopping:
                self.abandon(item)
            raise
        return response

    def abandon(self, item: Request) -> None:
        """Nobody reads the rest of this answer: its row stops choosing tokens, or it leaves the
        queue before it is decoded at all."""
        item.abandoned = True
        if item in self.queue:
            self.queue.remove(item)
        # its batch may yet fail: an exception nobody reads is logged as never retrieved
        item.done.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.metrics.requests.labels("abandoned").inc()

    async def send_events(self, request: web.Request, response: web.StreamResponse, item: Request) -> None:
        assert item.stream is not None
        await response.prepare(request)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        first = True
        while (token := await item.stream.get()) is not None:
            if text := decoder.decode(bytes([token])):
                await response.write(sse({**self.openai_fields(item, text, first=first), "text": text}))
                first = False
        if text := decoder.decode(b"", final=True):
            await response.write(sse({**self.openai_fields(item, text, first=first), "text": text}))
            first = False
        failed = False
        try:
            _, count, cached, queued, seconds = await item.done
        except Exception as error:
            failed = True
            await response.write(sse(stream_error(f"generation failed: {error!r}")))
        else:
            await response.write(sse({**self.openai_fields(item, "", count, cached, first), "done": True,
                                      "tokens": count, "cached_tokens": cached, "queue_seconds": queued,
                                      "seconds": seconds}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        # counted once the client has it all: a hang-up before counts as abandoned, not as both
        if failed:
            self.metrics.requests.labels("failed").inc()
        else:
            self.answered(item)

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list: the one model this replica serves, by its job's name (what the
        `model` field of a request may name)."""
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.job_name, "object": "model", "created": self.started, "owned_by": "huorn"}]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "queued": len(self.queue)})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(self.metrics.registry),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    # -- batching --------------------------------------------------------------------------------
    def take_batch(self) -> list[Request]:
        """The oldest request and the waiting ones of its prompt length, up to maxBatch."""
        first = self.queue[0]
        batch = [r for r in self.queue if len(r.tokens) == len(first.tokens)][: self.limits.max_batch]
        self.queue = [r for r in self.queue if r not in batch]
        return batch

    def prefill(self, batch: list[Request], prompt: torch.Tensor,
                steps: int) -> tuple[KVCache, torch.Tensor, list[int]]:
        """The batch's cache after its prompts, the last position's logits, and how many of each
        row's prompt tokens came from the prefix cache.

        Rows that can skip the same number of blocks are prefilled together; with more than one
        such group (prompts of one length from different preambles), each group is prefilled in
        a cache of its own and copied into the batch's, since one cache has one length for all
        its rows. The copy moves bytes; the prefill it saves is compute."""
        block = self.prefixes.block
        names = [prefix_cache.block_hashes(r.tokens) for r in batch]
        reused = [prefix_cache.reusable_blocks(len(r.tokens), self.prefixes.match(n)) * block
                  for r, n in zip(batch, names, strict=True)]
        length = prompt.shape[1]
        cache = self.model.build_cache(len(batch), length + steps)  # type: ignore[operator]
        groups: dict[int, list[int]] = {}
        for row, skip in enumerate(reused):
            groups.setdefault(skip, []).append(row)
        logits = torch.empty(0)
        for skip, rows in groups.items():
            whole = len(groups) == 1
            target = cache if whole else self.model.build_cache(len(rows), length)  # type: ignore[operator]
            for slot, row in enumerate(rows):
                if skip:
                    self.prefixes.load(target, slot, names[row][: skip // block])
            target.advance(skip)
            out = self.model.forward_step(prompt[rows, skip:], target, last_only=True)[:, -1].float()  # type: ignore[operator]
            if whole:
                logits = out
                break
            if not logits.numel():
                logits = out.new_empty(len(batch), out.shape[-1])
            logits[rows] = out
            index = torch.tensor(rows, device=prompt.device)
            pairs = zip([*cache.keys, *cache.values], [*target.keys, *target.values], strict=True)
            for mine, theirs in pairs:
                mine[index, :, :length] = theirs
        else:
            cache.advance(length)
        evicted = self.prefixes.stats.evicted_blocks
        for row, row_names in enumerate(names):
            self.prefixes.store(cache, row, row_names)
        self.metrics.prefix_evictions.inc(self.prefixes.stats.evicted_blocks - evicted)
        self.metrics.prefix_cache_bytes.set(self.prefixes.nbytes())
        self.metrics.prompt_tokens.labels("cache").inc(sum(reused))
        self.metrics.prompt_tokens.labels("prefill").inc(length * len(batch) - sum(reused))
        return cache, logits, reused

    def generate(self, batch: list[Request]) -> list[tuple[str, int, int]]:
        """One batch decoded together: each row samples at its own temperature and seed and
        stops (for the answer) at its own max_tokens or stop, and is answered then: a short
        answer, or one at its stop, does not wait for the batch's longest."""
        began = time.monotonic()
        device = next(self.model.parameters()).device
        steps = max(r.max_tokens for r in batch)
        prompt = torch.tensor([r.tokens for r in batch], dtype=torch.long, device=device)
        generators = [torch.Generator(device=device).manual_seed(r.seed) for r in batch]
        with torch.no_grad():
            cache, logits, cached = self.prefill(batch, prompt, steps)
            answers = [Answer(r) for r in batch]
            fed = 0  # tokens fed back after the prompts: their K/V is in the cache
            for step in range(steps):
                # the prompts are bytes (huorn.runtime.data.tokenizer): a model whose vocabulary
                # is larger chooses among the bytes only, or its answer could not be text
                logits = logits[:, : tokenizer.VOCABULARY]
                chosen = []
                for row, request in enumerate(batch):
                    if request.temperature > 0:
                        # the best logit subtracted first: a tiny temperature divides the rest
                        # towards -inf, never inf - inf (NaN), which would fail the whole batch
                        scaled = (logits[row] - logits[row].max()) / request.temperature
                        probs = torch.softmax(scaled, dim=-1)
                        chosen.append(int(torch.multinomial(probs, 1, generator=generators[row])))
                    else:
                        chosen.append(int(logits[row].argmax()))
                now = time.monotonic()
                for row, (answer, token) in enumerate(zip(answers, chosen, strict=True)):
                    ended = answer.finished
                    answer.add(token)
                    if step == 0:
                        answer.request.first_token_at = now
                    if not ended and answer.finished not in (None, "abandoned"):
                        answer.request.finish_reason = answer.finished
                        result = (tokenizer.decode(answer.tokens), len(answer.tokens), cached[row],
                                  began - answer.request.arrived, time.monotonic() - began)
                        answer.request.loop.call_soon_threadsafe(self.answer, answer.request, result)
                if all(a.finished for a in answers):  # every row at its stop or its max_tokens
                    break
                tokens = torch.tensor(chosen, dtype=torch.long, device=device)[:, None]
                logits = self.model.forward_step(tokens, cache, last_only=True)[:, -1].float()  # type: ignore[operator]
                fed += 1
        for answer in answers:
            answer.request.finish_reason = answer.finished
        out = [a.tokens for a in answers]
        self.keep_answers(batch, out, cache, fed)
        return [(tokenizer.decode(t), len(t), skipped) for t, skipped in zip(out, cached, strict=True)]

    def keep_answers(self, batch: list[Request], out: list[list[int]], cache: KVCache, fed: int) -> None:
        """Keep the blocks that each answer completes: a conversation's next turn is its prompt,
        this answer and a new question, and finds all but the new question cached. The cache
        holds K/V for the `fed` tokens decoded after the prompts (the last one sampled was never
        fed back); each row's own answer may be shorter than the batch's longest."""
        evicted = self.prefixes.stats.evicted_blocks
        for row, request in enumerate(batch):
            answered = request.tokens + out[row][:fed]
            if len(answered) // self.prefixes.block > len(request.tokens) // self.prefixes.block:
                self.prefixes.store(cache, row, prefix_cache.block_hashes(answered))
        self.metrics.prefix_evictions.inc(self.prefixes.stats.evicted_blocks - evicted)
        self.metrics.prefix_cache_bytes.set(self.prefixes.nbytes())

    def answer(self, request: Request, result: tuple[str, int, int, float, float]) -> None:
        """On the loop, after the tokens its decoding thread sent before (callbacks run in order).
        Its tokens are counted here, before its client can read the answer and then /metrics."""
        if not request.done.done():  # its handler may have been cancelled
            self.metrics.tokens.inc(result[1])
            request.done.set_result(result)
        if request.stream is not None:
            request.stream.put_nowait(None)

    async def run_batches(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.queue:
                batch = self.take_batch()
                started = time.monotonic()
                self.metrics.batch.observe(len(batch))
                try:
                    answers = await asyncio.to_thread(self.generate, batch)
                except Exception as error:  # a failed batch answers its requests, and serving goes on
                    self.metrics.busy.inc(time.monotonic() - started)
                    for r in batch:
                        if not r.done.done():  # its handler was cancelled (the server stopping)
                            r.done.set_exception(error)
                        if r.stream is not None:
                            r.stream.put_nowait(None)
                    continue
                seconds = time.monotonic() - started
                self.metrics.busy.inc(seconds)
                for r, (text, count, cached) in zip(batch, answers, strict=True):
                    if not r.done.done():  # answered as its row ended, or its handler was cancelled
                        self.answer(r, (text, count, cached, started - r.arrived, seconds))

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/healthz", self.healthz), web.get("/metrics", self.metrics_text),
                        web.get("/v1/models", self.models)])

        async def start_batching(app: web.Application) -> None:
            app[BATCHER] = asyncio.create_task(self.run_batches())

        async def stopping(app: web.Application) -> None:
            # before the runner waits for the handlers and cancels what is left
            self.stopping = True

        async def stop_batching(app: web.Application) -> None:
            app[BATCHER].cancel()

        app.on_startup.append(start_batching)
        app.on_shutdown.append(stopping)
        app.on_cleanup.append(stop_batching)
        return app


async def serve(cfg: ServeConfig) -> None:
    model, report = load_model(cfg)
    await run_until_signal(Server(cfg, model).app(), cfg, "serve.json", report, f"serving {cfg.job_name}")


async def run_until_signal(app: web.Application, cfg: ServeConfig, record: str, facts: dict,
                           what: str) -> None:
    """Serve `app` on the config's address until SIGTERM or SIGINT; the bound port (0 picks one)
    goes into run_dir/`record` with `facts`, which is how a supervisor or a test finds it."""
    # a closed connection cancels its handler: a client that gave up is not decoded for, and a
    # router's forward that the client left closes its connection to the replica in turn
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / record).write_text(json.dumps({**facts, "port": port, "time": time.time()}))
    print(f"huorn: {what} on {cfg.host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        cfg = ServeConfig.model_validate(json.loads(args.config.read_text()))
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
