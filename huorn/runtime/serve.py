"""The serving runtime of an InferenceJob replica: one model (GLVQ-quantised when the spec says so)
behind an HTTP API, with requests batched and Prometheus metrics.

    python -m huorn.runtime.serve --config serve-config.json

- `POST /v1/completions` {"prompt": str | [byte ids], "max_tokens": int, "temperature": float, "seed": int,
  "stop": str | [str], "stream": bool}
  → {"text", "tokens", "cached_tokens", "queue_seconds", "seconds"}. Prompts are byte-tokenised,
  as in training; `cached_tokens` counts the prompt's tokens whose K/V the prefix cache gave.
- The answers also carry OpenAI's completions fields (`id`, `object`, `created`, `model`,
  `choices`, `usage` with `prompt_tokens_details.cached_tokens`), so OpenAI and vLLM clients read
  them; a request's `model`, when given, must be the job's name (`GET /v1/models`), else 404.
- `GET /healthz` is 200 once the model is loaded (a readiness probe), `GET /metrics` the
  Prometheus text: requests, generated tokens, seconds spent decoding (the busy fraction the
  operator's autoscaler reads), latency and batch-size histograms.

Batching (`huorn.runtime.continuous_batching`): requests wait in one queue; before every decoding
step the oldest join the running batch, as many as it has free rows of `serving.maxBatch`, and each
leaves as its own answer ends (continuous batching; `serving.batching: static` admits only into
an empty batch). Prompts of any lengths share a step: each row has its own position in one
ragged KV cache. Each prompt skips the prefill of its leading blocks held in the prefix cache
(`huorn.runtime.prefix_cache`, `serving.prefixCacheTokens`), and keeps its prompt's blocks there
for the next ones, and the blocks its answer completes (a conversation's next turn carries
them). Generation runs in a worker thread, so the server keeps accepting while it decodes. A
request asking for more than `serving.maxTokens` tokens in all, or past the model's context, is
refused with 400 naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import dataclasses
import json
import math
import re
import secrets
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import prometheus_client
import torch
from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from pydantic import Field

from huorn import models
from huorn.api import base, files, inference, training
from huorn.runtime import (
    chat,
    checkpoint,
    continuous_batching,
    glvq,
    logprobs,
    prefix_cache,
    profiling,
    prompt,
)
from huorn.runtime import config as run_config
from huorn.runtime.continuous_batching import Request, Result
from huorn.runtime.data import sampler
from huorn.runtime.logprobs import TokenLogprob

CALIBRATION_SOURCES = ("general", "code", "math")
CHAT_DEFAULT_TOKENS = 256  # a chat answer's cap when the request gives none
# OpenAI's fields this server does not honour, each with the values that ask for nothing (what
# SDKs send by default): any other value is refused naming the field, never silently ignored
NOT_SERVED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "suffix": (None, ""),
    # tool calling and structured output (LangChain's bind_tools, with_structured_output): a plain
    # text answer to them reads as a final answer, or fails to parse
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    # vLLM's sampling extensions, which benchmark scripts send
    "top_k": (None, -1, 0), "min_p": (None, 0), "repetition_penalty": (None, 1), "ignore_eos": (None, False),
}
# A field's name at the start of a refusal ("max_tokens: ...", "messages[2].role: ..."): OpenAI's
# error.param, which clients show beside the message
FIELD_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\])?(?:\.\w+(?:\[\d+\])?)*): ")
MAX_BODY_BYTES = 64 << 20  # as the router: a batch of 2,048 prompts as token ids passes 1 MiB
SERVED = ("model, prompt (one or a list) or messages, max_tokens, temperature, top_p, n, seed, stop, "
          "stream, stream_options, logprobs (and the chat API's top_logprobs), echo")
BATCHER = web.AppKey("batcher", asyncio.Task)
# What a replica whose queue is full asks a client to wait (Retry-After): a hint, about one
# batch of short answers; OpenAI's SDKs wait at least this long before they retry.
RETRY_AFTER_SECONDS = 1


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
    if cfg.device == "cuda" and not torch.cuda.is_available():
        # Checked before the slow load: a replica with GPUs whose image has a CPU-only torch
        # served on the CPU unnoticed, holding GPUs it never used.
        raise ValueError("device cuda: this replica asks for GPUs, but its torch has no CUDA (a "
                         "CPU-only build, or no GPU visible); run a CUDA build of the image "
                         "(the chart's default job image, <tag>-cu126)")
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
    model.eval().requires_grad_(False)  # served, never trained: no step records a graph
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
    dtype = serving_dtype(device)
    report["dtype"] = str(dtype).removeprefix("torch.")
    return model.to(device=device, dtype=dtype), report


def serving_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, as training computes there: a decoding step reads every weight and the
    batch's whole KV cache, so half the bytes is nearly half the step, and the cache holds twice
    the rows. fp32 on a CPU, whose bf16 matmuls are slower than its fp32 ones. Logits are
    sampled in fp32 either way."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def save_untrained(root: Path, architecture: training.ModelSpec, seed: int = 0) -> Path:
    """A freshly initialised model as a servable checkpoint: load tests and benchmarks measure
    what serving costs, not what it answers, and need no training run first."""
    torch.manual_seed(seed)
    model = models.build_model(run_config.build_model_config(architecture))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return checkpoint.save_checkpoint(root, 1, model, torch.optim.AdamW(model.parameters()),
                                          {"model": architecture.to_wire()}, rank=0, barrier=lambda: None)


def read_number(body: dict, name: str, kind: type[int] | type[float], default: float) -> Any:
    """A numeric field, its default when absent or null (as OpenAI reads null); ValueError naming
    it otherwise (int() would take "12", 1.5 or true and say nothing of which field was wrong)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise ValueError(f"{name}: give {'an integer' if kind is int else 'a number'}, not {value!r}")
    return kind(value)


def read_logprobs(body: dict, is_chat: bool) -> int | None:
    """How many alternatives to report beside each token's log-probability; None: none asked.
    The chat API asks with `logprobs: true` and counts with `top_logprobs`; the completions API
    counts with `logprobs` itself (false, as some clients send, is none)."""
    if is_chat:
        asked = body.get("logprobs")
        if asked not in (None, True, False):
            raise ValueError("logprobs: give true or false (top_logprobs says how many alternatives)")
        top = read_number(body, "top_logprobs", int, 0)
        if not 0 <= top <= logprobs.MAX_CHAT_ALTERNATIVES:
            raise ValueError(f"top_logprobs: give 0 to {logprobs.MAX_CHAT_ALTERNATIVES}")
        if top and not asked:
            raise ValueError("top_logprobs: set logprobs to true with it")
        return top if asked else None
    if body.get("top_logprobs") is not None:
        raise ValueError("top_logprobs: the chat API's field; the completions API counts with logprobs: N")
    if body.get("logprobs") is False:
        return None
    count = read_number(body, "logprobs", int, -1)
    if count == -1:
        return None
    if not 0 <= count <= logprobs.MAX_COMPLETION_ALTERNATIVES:
        raise ValueError(f"logprobs: give 0 to {logprobs.MAX_COMPLETION_ALTERNATIVES} (the likeliest "
                         "tokens reported beside each chosen one), or leave it out")
    return count


def read_echo(body: dict, is_chat: bool) -> bool:
    """The completions API's `echo`: the prompt's text (and, with `logprobs`, its
    log-probabilities) before the answer's."""
    echo = body.get("echo")
    if echo in (None, False):
        return False
    if is_chat:
        raise ValueError("echo: the completions API's field; a chat's messages are the client's own")
    if echo is not True:
        raise ValueError(f"echo: give true or false, not {echo!r}")
    return True


def read_stream_options(body: dict, stream: bool) -> bool:
    """OpenAI's `stream_options.include_usage`: a last chunk with no choice and the request's
    usage. Only with `stream`, as OpenAI has it."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ValueError("stream_options: only with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            options.get("include_usage") not in (None, True, False):
        raise ValueError("stream_options: give {\"include_usage\": true or false}")
    return bool(options.get("include_usage"))


def echoed(item: Request) -> list[TokenLogprob] | None:
    """The log-probabilities a choice reports: its prompt's first where it is echoed."""
    if item.answer_logprobs is None or not item.echo:
        return item.answer_logprobs
    return (item.prompt_logprobs or []) + item.answer_logprobs


def error_body(message: str, status: int = 500, code: str | None = None) -> dict:
    """OpenAI's error body, {"error": {message, type, param, code}}: SDKs raise it with these
    fields (a bare string leaves them None, and typed clients fail to decode it), and the openai
    SDK reads a stream's error event the same way."""
    field = FIELD_PREFIX.match(message)
    # a 429 is no fault of the request: OpenAI types it apart, and clients that branch on the
    # type (retry a rate limit, never an invalid request) must not read it as one
    kind = ("server_error" if status >= 500 else "rate_limit_exceeded" if status == 429
            else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": field[1] if field else None, "code": code}}


def error_response(message: str, status: int, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, status, code), status=status, headers=headers)


def stream_error(message: str) -> dict:
    """An error event mid-stream: the headers (200) are sent, so the error goes in the stream."""
    return error_body(message, 500)


def sse(event: dict) -> bytes:
    """One server-sent event: a client reads `data:` lines until `data: [DONE]`."""
    return f"data: {json.dumps(event)}\n\n".encode()


class RowSeconds:
    """The area under the in-flight gauge: rows in flight integrated over time, exported as a
    counter. Its rate over any interval is exactly the mean number of rows in flight then, which
    the autoscaler divides by the batch's rows. Little's law on the latency histogram's sum gave
    that mean only for answers much shorter than the scrape interval: it charged each request's
    whole duration to the interval it ended in, so waves of 25 s answers read 20-23 rows in
    flight where 8 were, and the job grew to twice the replicas it needed."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.rows = 0.0
        self.area = 0.0
        self.since = clock()

    def change(self, rows: float) -> None:
        with self.lock:
            now = self.clock()
            self.area += self.rows * (now - self.since)
            self.rows, self.since = self.rows + rows, now

    def total(self) -> float:
        with self.lock:
            return self.area + self.rows * (self.clock() - self.since)

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("huorn_serve_in_flight_row_seconds", "Rows in flight integrated over "
                                  "time: its rate is the mean of huorn_serve_in_flight.", value=self.total())


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
        self.in_flight = prometheus_client.Gauge(
            "huorn_serve_in_flight", "Batch rows (prompts × choices) accepted, not yet answered.",
            registry=self.registry)
        self.row_seconds = RowSeconds()
        self.registry.register(self.row_seconds)
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
        self.inter_token = prometheus_client.Histogram(
            "huorn_serve_inter_token_seconds", "Between two tokens of one answer, as chosen: what a "
            "streaming client waits between two events (decoding steps, and the prefills of prompts "
            "joining between them).", registry=self.registry,
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5))
        self.batch = prometheus_client.Histogram(
            "huorn_serve_batch_size", "Requests decoded together, observed at every decoding step.",
            registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128))

    def rows_in_flight(self, rows: int) -> None:
        """Rows accepted (positive) or answered (negative): the gauge and its area together."""
        self.in_flight.inc(rows)
        self.row_seconds.change(rows)


class Server:
    def __init__(self, cfg: ServeConfig, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.model = model
        self.limits = cfg.spec.serving
        self.context = cfg.spec.model.architecture.context
        self.queue: list[Request] = []
        # the handlers append to the queue, the decoding thread takes from it before every step
        self.queue_lock = threading.Lock()
        self.admitting: list[Request] = []  # taken from the queue, not yet the batch's
        self.evictions_counted = 0  # the prefix cache's evictions already in the metric
        self.wake = asyncio.Event()
        self.metrics = Metrics()
        self.prefixes = prefix_cache.PrefixCache(self.limits.prefix_cache_tokens)
        self.running = continuous_batching.RunningBatch(
            model, self.prefixes, min(self.context, self.limits.max_tokens), self.limits.max_batch,
            fixed_steps=None if self.limits.cuda_graphs else False)
        # the last iteration that prefilled, whole (prefill and step): what an arrival's own
        # prefill would cost the answers being decoded (`prefillDelayFactor`)
        self.last_prefill_seconds = 0.0
        self.profile = profiling.DecodeProfile.from_env()  # HUORN_SERVE_PROFILE: off unless set
        self.started = int(time.time())
        self.stopping = False  # handlers cancelled as the server stops are not abandoned
        # the drain is over (on_cleanup): what is still queued or decoding is nobody's answer, and
        # the decoding thread ends at its next step rather than decode it all while the process
        # waits for it (the pod holding its GPU to the end of its grace, and past it)
        self.closed = False

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
            prompts = prompt.prompts_of(body, is_chat)
            for name, nothing in NOT_SERVED.items():
                if body.get(name) not in nothing:
                    raise ValueError(f"{name}: not served by this replica (it serves {SERVED}); leave "
                                     f"it out or set it to {nothing[-1]!r}")
            limit = min(self.limits.max_tokens, self.context)
            # OpenAI's chat API has no default cap (an answer runs to its end-of-turn token or the
            # context, and SDKs send none) and names it max_completion_tokens now; its completions
            # API's is 16. These models have no end-of-turn token (an answer ends at a stop, which
            # an untrained or plain-text model may never write): a chat with no cap gets
            # CHAT_DEFAULT_TOKENS, or what fits, rather than the whole context every time
            name = "max_completion_tokens" if is_chat and body.get("max_completion_tokens") is not None \
                else "max_tokens"
            fits = max(1, limit - max(len(tokens) for tokens in prompts))
            wanted = read_number(body, name, int, min(CHAT_DEFAULT_TOKENS, fits) if is_chat else 16)
            # OpenAI's defaults: temperature 1, and a fresh draw unless a seed is given (greedy and
            # seed 0 had made n choices, and every "regenerate", the same answer)
            temperature = read_number(body, "temperature", float, 1.0)
            top_p = read_number(body, "top_p", float, 1.0)
            choices = read_number(body, "n", int, 1)
            seed = read_number(body, "seed", int, secrets.randbits(62))
            alternatives = read_logprobs(body, is_chat)
            echo = read_echo(body, is_chat)
            model = body.get("model")
            if model is not None and model != self.cfg.job_name:
                self.metrics.requests.labels("refused").inc()
                message = (f"model: this replica serves {self.cfg.job_name!r} (its InferenceJob's name), "
                           f"not {model!r}; GET /v1/models lists it")
                return error_response(message, 404, "model_not_found")
            stop = body.get("stop")
            stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
            if not isinstance(stops, list) or len(stops) > 4 or \
                    not all(isinstance(x, str) and 0 < len(x.encode()) <= 64 for x in stops):
                raise ValueError("stop: give a string or a list of up to 4, each of 1-64 bytes")
            stream = body.get("stream")
            stream = False if stream is None else stream  # null is the default, as OpenAI reads it
            if not isinstance(stream, bool):
                raise ValueError("stream: give true (server-sent events, a token at a time) or false")
            include_usage = read_stream_options(body, stream)
            if wanted < (0 if echo else 1):
                raise ValueError(f"{name}: give 1 or more (0 only with echo: the prompt scored, nothing "
                                 "answered)")
            if not 0 <= temperature < math.inf:  # NaN too: it fails its whole batch
                raise ValueError("temperature: give a finite number ≥ 0")
            if not 0 <= top_p <= 1:
                raise ValueError("top_p: give a number from 0 to 1 (1 samples from every token)")
            if not 1 <= choices <= self.limits.max_batch:
                raise ValueError(f"n: give 1 to {self.limits.max_batch} (spec.serving.maxBatch: the "
                                 "choices of one request are decoded side by side)")
            if not -(2**63) <= seed <= 2**64 - choices:
                # each choice seeds a generator with seed + its index, which takes 64 bits: a
                # larger one failed the whole prefill it joined, other requests' included
                raise ValueError(f"seed: give an integer from -2^63 to 2^64 - n ({2**64 - choices})")
            vocabulary = self.cfg.spec.model.architecture.vocabulary
            for i, tokens in enumerate(prompts):
                which = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
                if max(tokens) >= vocabulary:
                    # a model of fewer tokens than bytes (the API allows 2 up) has no embedding for
                    # it: the IndexError had failed every request of the batch it joined
                    field = "messages" if is_chat else which
                    raise ValueError(f"{field}: byte {max(tokens)} is beyond the model's vocabulary of "
                                     f"{vocabulary} tokens (spec.model.architecture.vocabulary); send "
                                     f"text of bytes below {vocabulary} (ASCII is below 128)")
                if len(tokens) + wanted > limit:
                    raise ValueError(f"{name}: {which} ({len(tokens)} tokens) + {name} ({wanted}) exceeds "
                                     f"{limit} (spec.serving.maxTokens and the model's context); ask for "
                                     "fewer")
        except web.HTTPRequestEntityTooLarge:
            self.metrics.requests.labels("refused").inc()
            return error_response(f"the body: larger than {MAX_BODY_BYTES >> 20} MiB; send fewer prompts "
                                  "a request", 413)
        except (KeyError, ValueError, TypeError, OverflowError, RecursionError, LookupError) as error:
            # RecursionError: JSON nested past the parser's depth; LookupError: an unknown charset
            # in Content-Type (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
            self.metrics.requests.labels("refused").inc()
            message = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            if isinstance(error, RecursionError):
                message = "the body: JSON nested too deeply"
            return error_response(message, 400)
        stops += [s for s in chat.STOPS if is_chat and s not in stops]
        # `n` choices of each prompt are `n` rows with seeds seed, seed + 1, ...; choice j of
        # prompt i has index i * n + j, as OpenAI numbers them; their stream is shared, each token
        # tagged with its choice's index
        shared = asyncio.Queue() if stream else None
        first = Request(prompts[0], wanted, temperature, seed, stream=shared, top_p=top_p,
                        stop=tuple(x.encode() for x in stops), chat=is_chat, logprobs=alternatives, echo=echo)
        items = [first] + [dataclasses.replace(first, tokens=prompts[i // choices], seed=seed + i % choices,
                                               index=i, done=first.loop.create_future())
                           for i in range(1, choices * len(prompts))]
        with self.queue_lock:
            bound = self.limits.max_queued
            full = bool(bound and self.queue and len(self.queue) + len(items) > bound)
            if not full:
                self.queue.extend(items)
        if full:
            self.metrics.requests.labels("overloaded").inc()
            return error_response(f"overloaded: {len(self.queue)} rows wait for this replica's batch "
                                  f"(spec.serving.maxQueued {self.limits.max_queued}); retry after "
                                  f"{RETRY_AFTER_SECONDS} s", 429, "rate_limit_exceeded",
                                  headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.wake.set()
        # rows, not requests: the autoscaler divides it by maxBatch rows, and a request of `n`
        # choices of several prompts fills as many rows (it read a full replica as nearly idle)
        self.metrics.rows_in_flight(len(items))
        try:
            if shared is not None:
                return await self.stream_answer(request, items, include_usage, choices)
            try:
                results = await asyncio.gather(*(item.done for item in items))
            except asyncio.CancelledError:
                # the client hung up (its time-out, then a retry: under load, the decode it
                # abandons is what the retry waits behind); run_until_signal's runner cancels
                # the handler of a closed connection
                if not self.stopping:
                    self.abandon(items)
                raise
            except Exception as error:  # the batch failed: this request is answered, and counted
                self.metrics.requests.labels("failed").inc()
                return error_response(f"generation failed: {error!r}", 500)
        finally:
            self.metrics.rows_in_flight(-len(items))
        self.answered(items[0])
        fields = self.openai_fields(items[0], *results[0][:3])
        fields["choices"] = [self.openai_fields(item, *result[:3], entries=echoed(item))["choices"][0]
                             for item, result in zip(items, results, strict=True)]
        fields["usage"] = self.usage(items[::choices], sum(r[1] for r in results),
                                     sum(r[2] for r in results[::choices]))
        # Huorn's own fields: the first choice's
        text, count, cached, queued, seconds = results[0]
        return web.json_response({**fields, "text": text, "tokens": count, "cached_tokens": cached,
                                  "queue_seconds": queued, "seconds": seconds})

    def openai_fields(self, item: Request, text: str, count: int | None = None,
                      cached: int | None = None, first: bool = True,
                      entries: Sequence[TokenLogprob] | None = None,
                      offsets: Sequence[int] | None = None) -> dict:
        """The answer as OpenAI's completions API shapes it, beside Huorn's own fields, so the
        clients and SDKs written for it (and for vLLM, which follows it) read it unchanged.
        `entries`: the log-probabilities of the text's tokens, where the request asked for them
        (`offsets`: a stream's text_offset of each, counted across its chunks).

        A stream's role comes in its `first` chunk only: the openai SDK joins a stream's deltas
        field by field, and a role in every chunk came out "assistantassistant..."."""
        finish = item.finish_reason if count is not None else None
        shaped = None
        if item.logprobs is not None and entries is not None:
            shaped = logprobs.chat_logprobs(entries) if item.chat else \
                logprobs.completion_logprobs(entries, offsets=offsets)
        if item.chat:
            chunk = item.stream is not None
            message = {"role": "assistant", "content": text} if first else {"content": text}
            content = {"delta" if chunk else "message": message}
            fields: dict = {"id": f"chat{item.id}", "object": "chat.completion.chunk" if chunk else
                            "chat.completion", "created": item.created, "model": self.cfg.job_name,
                            "choices": [{"index": item.index, **content, "logprobs": shaped,
                                         "finish_reason": finish}]}
        else:
            fields = {"id": item.id, "object": "text_completion", "created": item.created,
                      "model": self.cfg.job_name,
                      "choices": [{"index": item.index, "text": text, "logprobs": shaped,
                                   "finish_reason": finish}]}
        if count is not None:
            fields["usage"] = self.usage([item], count, cached)
        return fields

    @staticmethod
    def usage(prompts: Sequence[Request], completion: int, cached: int | None) -> dict:
        """OpenAI's `usage`: each prompt once (`prompts`: a request of each), whatever `n`;
        completion tokens of every choice."""
        prompt_tokens = sum(len(item.tokens) for item in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def answered(self, item: Request) -> None:
        self.metrics.requests.labels("ok").inc()
        self.metrics.latency.observe(time.monotonic() - item.arrived)

    async def stream_answer(self, request: web.Request, items: list[Request],
                            include_usage: bool = False, choices: int = 1) -> web.StreamResponse:
        """Server-sent events: {"text"} as the tokens come (bytes held back until they complete a
        UTF-8 character), each chunk naming its choice's index, then {"done", "tokens",
        "cached_tokens", "queue_seconds", "seconds"} per choice, or {"error"}, then [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await self.send_events(request, response, items, include_usage, choices)
        except ConnectionResetError:
            # the client hung up (a chat UI's stop button): the rest of its answer is decoded for
            # no one, and a traceback per hang-up would be noise
            self.abandon(items)
        except asyncio.CancelledError:  # the same, seen while it waited for its next token
            if not self.stopping:
                self.abandon(items)
            raise
        return response

    def abandon(self, items: list[Request]) -> None:
        """Nobody reads the rest of these answers (one request's choices): their rows stop
        choosing tokens, or they leave the queue before they are decoded at all."""
        for item in items:
            item.abandoned = True
            with self.queue_lock:
                if item in self.queue:
                    self.queue.remove(item)
            # its batch may yet fail: an exception nobody reads is logged as never retrieved
            item.done.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.metrics.requests.labels("abandoned").inc()

    async def send_events(self, request: web.Request, response: web.StreamResponse,
                          items: list[Request], include_usage: bool = False, choices: int = 1) -> None:
        """`choices`: each prompt's `n` (items i * n ... i * n + n - 1 are prompt i's)."""
        stream = items[0].stream
        assert stream is not None
        await response.prepare(request)
        decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in items]
        first = [True] * len(items)
        open_choices = len(items)
        # each choice's log-probabilities of the tokens its next chunk holds (a byte that begins a
        # character waits for the rest), and each one's text_offset: the characters its decoder
        # gave before it, all of them sent (a chunk may begin inside a character)
        measured: list[list[TokenLogprob]] = [[] for _ in items]
        offsets: list[list[int]] = [[] for _ in items]
        sent = [0] * len(items)
        echoing = [item.echo for item in items]  # its prompt goes first, once it has been prefilled

        async def send(index: int, text: str) -> None:
            chunk = self.openai_fields(items[index], text, first=first[index], entries=measured[index],
                                       offsets=offsets[index])
            await response.write(sse({**chunk, "text": text}))
            first[index], measured[index], offsets[index] = False, [], []
            sent[index] += len(text)

        async def echo(index: int) -> None:
            """The prompt's text (and log-probabilities, measured as it was prefilled) before the
            first token of the answer, or before its end where nothing is answered."""
            item, echoing[index] = items[index], False
            if item.prompt_logprobs is not None:
                measured[index] += item.prompt_logprobs
                offsets[index] += logprobs.text_offsets(item.prompt_logprobs, sent[index])
            if text := decoders[index].decode(bytes(item.tokens)):
                await send(index, text)

        while open_choices:
            index, token, entry = await stream.get()
            if echoing[index]:
                await echo(index)
            if token is not None:
                if entry is not None:
                    measured[index].append(entry)
                    offsets[index].append(sent[index])
                if text := decoders[index].decode(bytes([token])):
                    await send(index, text)
                continue
            open_choices -= 1  # this choice has ended
            if (text := decoders[index].decode(b"", final=True)) or measured[index]:
                await send(index, text)
        failed = False
        totals: list[tuple[int, int]] = []  # each choice's tokens and prompt tokens from the cache
        for item in items:
            try:
                _, count, cached, queued, seconds = await item.done
            except Exception as error:
                failed = True
                await response.write(sse(stream_error(f"generation failed: {error!r}")))
                break
            last = self.openai_fields(item, "", count, cached, first[item.index])
            # a choice's own count is not the request's, and with include_usage the usage chunk is
            # the one chunk with usage (clients that add up every chunk's would count it twice)
            if len(items) > 1 or include_usage:
                del last["usage"]
            await response.write(sse({**last, "done": True, "tokens": count, "cached_tokens": cached,
                                      "queue_seconds": queued, "seconds": seconds}))
            totals.append((count, cached))
        if include_usage and not failed:
            # OpenAI's usage chunk: no choice, the whole request's usage (each prompt counted once)
            chunk = self.openai_fields(items[0], "", 0, 0)
            chunk["usage"] = self.usage(items[::choices], sum(c for c, _ in totals),
                                        sum(c for _, c in totals[::choices]))
            await response.write(sse({**chunk, "choices": []}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        # counted once the client has it all: a hang-up before counts as abandoned, not as both
        if failed:
            self.metrics.requests.labels("failed").inc()
        else:
            self.answered(items[0])

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
    def admissions(self, now: float | None = None) -> list[Request]:
        """The oldest waiting requests that join the running batch before its next step: as many
        as it has free rows (`continuous`), or, with `static`, a whole batch once it is empty.
        With `prefillDelayFactor`, arrivals wait while answers are decoded until the oldest has
        waited that many last prefills, unless they fill every free row. The caller holds
        `queue_lock`."""
        busy = len(self.running) + self.running.waiting()
        free = self.limits.max_batch - busy
        if self.limits.batching == "static" and busy:
            free = 0
        elif busy and self.queue and len(self.queue) < free and self.limits.prefill_delay_factor:
            waited = (time.monotonic() if now is None else now) - self.queue[0].arrived
            if waited < self.limits.prefill_delay_factor * self.last_prefill_seconds:
                free = 0
        taken, self.queue = self.queue[:free], self.queue[free:]
        return taken

    def decode(self) -> None:
        """The decoding thread's loop, until nothing is waiting or running: before every step the
        waiting requests that fit join, up to a chunk of the joining prompts is prefilled, then a
        step; each answer is handed to its loop as its row ends. It takes the requests itself,
        under `queue_lock`, rather than return to the event loop at each arrival: one thread
        hand-off per busy period instead of one per request (measured on CPU, the gaps between
        tokens did not change with it: they come from the prefills between the steps)."""
        with self.profile.decoding():
            self._decode()

    def _decode(self) -> None:
        while not self.closed:
            started = time.monotonic()
            with self.queue_lock:
                self.admitting = self.admissions()
            if self.admitting:
                stats = self.running.admit(self.admitting)
                self.metrics.prompt_tokens.labels("cache").inc(stats.cached_tokens)
                self.metrics.prompt_tokens.labels("prefill").inc(stats.prefilled_tokens)
                self.admitting = []
            if not (len(self.running) or self.running.prefilling):
                break
            prefilled = bool(self.running.prefilling)
            # up to a chunk of the admitted prompts first: a long one holds the rows a chunk a step
            self.running.prefill(self.limits.prefill_chunk_tokens)
            # scored prompts that ask for no answer go before the step: taken out of the batch,
            # they would be lost if it failed (no longer in `early` for `clear` to find)
            self.deliver(self.running.take_early())
            if len(self.running):
                self.metrics.batch.observe(len(self.running))
                answered = self.running.step()
                for gap in self.running.token_gaps:
                    self.metrics.inter_token.observe(gap)
                self.running.token_gaps.clear()
                for wait in self.running.first_token_waits:
                    self.metrics.first_token.observe(wait)
                self.running.first_token_waits.clear()
                self.deliver(answered)
                self.running.feed()  # may fail: the answers above are made, and reach their clients
            self.count_evictions()
            took = time.monotonic() - started
            if prefilled:
                self.last_prefill_seconds = took
            # counted as it goes: the autoscaler reads its rate while the loop runs for minutes
            self.metrics.busy.inc(took)
        self.metrics.prefix_cache_bytes.set(self.prefixes.nbytes())

    def deliver(self, answered: list[tuple[Request, Result]]) -> None:
        """Answers to their loops, after the prefix cache's evictions are counted and its size
        set: a client that has its answer may read /metrics next (the size was set only once the
        decoding loop ended, and a client quick enough read the one before its answer's blocks)."""
        if not answered:
            return
        self.count_evictions()
        self.metrics.prefix_cache_bytes.set(self.prefixes.nbytes())
        for request, result in answered:
            request.loop.call_soon_threadsafe(self.answer, request, result)

    def count_evictions(self) -> None:
        """The prefix cache's evictions since the last count, into its counter: its stores happen
        as prompts become whole and as answers end."""
        evicted = self.prefixes.stats.evicted_blocks
        self.metrics.prefix_evictions.inc(evicted - self.evictions_counted)
        self.evictions_counted = evicted

    def generate(self, batch: list[Request]) -> list[tuple[str, int, int]]:
        """`batch` decoded together to its end, outside the serving loop: (text, tokens, cached
        tokens) for each (tests and tools that drive the model directly)."""
        results = self.running.run_to_end(batch)
        return [(text, count, cached) for text, count, cached, _, _ in results]

    def answer(self, request: Request, result: Result) -> None:
        """On the loop, after the tokens its decoding thread sent before (callbacks run in order).
        Its tokens are counted here, before its client can read the answer and then /metrics,
        whether or not anyone reads it: they were decoded (a plain request whose client hung up
        has a cancelled future, and its tokens went uncounted while a stream's were counted)."""
        self.metrics.tokens.inc(result[1])
        if not request.done.done():  # its handler may have been cancelled
            request.done.set_result(result)
        if request.stream is not None:
            request.stream.put_nowait((request.index, None, None))

    async def run_batches(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.queue or len(self.running) or self.running.prefilling:
                try:
                    await asyncio.to_thread(self.decode)
                except Exception as error:  # a failed step answers its requests, and serving goes on
                    # scored prompts answered by a prefill before the failure were computed: they go
                    self.deliver(self.running.take_early())
                    failed = self.running.clear()
                    failed += [r for r in self.admitting if r not in failed]
                    self.admitting = []
                    for r in failed:
                        # done already: answered by a step before the failure (its stream has its
                        # end, and a second one would close a shared stream before its other
                        # choices), or its handler was cancelled (the server stopping)
                        if r.done.done():
                            continue
                        r.done.set_exception(error)
                        if r.stream is not None:
                            r.stream.put_nowait((r.index, None, None))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
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
            # the handlers still waiting were cancelled at the drain's end: their requests go
            self.closed = True
            with self.queue_lock:
                self.queue.clear()
            app[BATCHER].cancel()
            written = self.profile.write()
            if written is not None:
                print(f"huorn: the decoding loop's profile is in {written}", file=sys.stderr, flush=True)

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
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=inference.SERVE_DRAIN_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as error:  # the port is taken, or the address is not this host's
        await runner.cleanup()
        raise ValueError(f"cannot listen on {cfg.host}:{cfg.port} ({error.strerror}); choose another "
                         "port, or 0 for a free one") from None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    # before the record: whoever reads it may stop the server at once, and is then answered
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # whole or not at all: huorn run polls for this file and reads it as soon as it exists
    files.write_text_atomically(run_dir / record, json.dumps({**facts, "port": port, "time": time.time()}))
    print(f"huorn: {what} on {cfg.host}:{port}", file=sys.stderr, flush=True)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        cfg = run_config.read_config(args.config, ServeConfig, "serving config")
    except ValueError as error:
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
