"""Continuous batching for a serving replica: the requests in flight are decoded together, each at
its own position, and one joins or leaves between two decoding steps (Orca's iteration-level
scheduling, what vLLM and TGI do).

Before, a batch was the oldest request and the waiting ones of its prompt length, decoded to its
longest answer before the next batch began: a request that arrived a step after a batch started
waited for all of it, and prompts of other lengths never shared a step. Here the running batch is
one `RaggedKVCache` whose first `rows` rows are the requests in flight. A request is admitted
between two steps (`admit`): its prompt is prefilled in a cache of its own (with the prompts of
its length that skip as many cached blocks) and placed in a free row; a step (`step`) chooses a
token for every row, answers the rows that end, and feeds the others' tokens back in one forward
pass. A row that ends is replaced by the last one, so a step never computes a free row.

The server decides when to admit (`spec.serving.batching`): `continuous` fills free rows before
every step, `static` only once the running batch is empty (request-level batching, kept for
comparison: benchmarks/serving_continuous_batching.py).

Prompts are bytes (huorn.runtime.data.tokenizer); a model whose vocabulary is larger chooses among
the bytes only, or its answer could not be text. Runs in the server's decoding thread: the
requests' futures and streams are reached through their loops' call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from huorn.models.cache import KVCache, RaggedKVCache
from huorn.runtime import prefix_cache
from huorn.runtime.data import tokenizer

# (text, tokens, prompt tokens from the prefix cache, seconds queued, seconds decoding)
Result = tuple[str, int, int, float, float]


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
    first_token_at: float | None = None  # when its first token was chosen
    stop: tuple[bytes, ...] = ()  # the answer ends before the first of these it would contain
    finish_reason: str | None = None  # "stop" or "length", once decoded
    chat: bool = False  # asked through the chat API: answered in its shape
    # Its client went (a streamed answer's connection closed): its row stops choosing tokens.
    abandoned: bool = False
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    index: int = 0  # which of its HTTP request's `n` choices it is (their stream is shared)
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
        if self.request.abandoned:  # nobody reads the rest: its row may leave the batch
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
            request.loop.call_soon_threadsafe(request.stream.put_nowait, (request.index, token))
        self.streamed = max(self.streamed, end)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` kept on the most likely tokens whose mass first reaches top_p (the top one at
    least), the rest zeroed: multinomial sampling renormalises (Holtzman et al., 2020)."""
    ordered, order = probs.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < top_p
    keep[0] = True
    return torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])


@dataclass
class Row:
    """A request in the running batch."""

    answer: Answer
    generator: torch.Generator
    cached: int  # its prompt's tokens whose K/V the prefix cache gave
    began: float  # when its prefill began
    logits: torch.Tensor  # [V] its next token's
    # every token chosen, stop sequences included: the cache holds K/V for all but the last
    chosen: list[int] = field(default_factory=list)


@dataclass
class AdmitStats:
    """What one admission did, for the server's metrics."""

    cached_tokens: int = 0
    prefilled_tokens: int = 0
    evicted_blocks: int = 0


class RunningBatch:
    def __init__(self, model: torch.nn.Module, prefixes: prefix_cache.PrefixCache, max_length: int,
                 max_rows: int = 1 << 12) -> None:
        self.model = model
        self.prefixes = prefixes
        self.max_length = max_length
        self.max_rows = max_rows  # what the cache grows to by doubling (more only if admitted)
        self.device = next(model.parameters()).device
        self.rows: list[Row] = []
        self.cache: RaggedKVCache | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def _room(self, rows: int) -> RaggedKVCache:
        """A cache for `rows` rows, grown by doubling (a replica serving one client at a time
        keeps one row, not serving.maxBatch of them)."""
        if self.cache is None:
            self.cache = self.model.build_ragged_cache(max(1, rows), self.max_length)  # type: ignore[operator]
        if rows > self.cache.capacity:
            self.cache.grow(max(rows, min(2 * self.cache.capacity, self.max_rows)))
        return self.cache

    def admit(self, requests: Sequence[Request]) -> AdmitStats:
        """Prefill `requests` and give each a row. Each prompt skips the prefill of its leading
        blocks held in the prefix cache; prompts of one length that skip as many blocks are
        prefilled together, each such group in a cache of its own, copied into its rows."""
        began = time.monotonic()
        stats = AdmitStats()
        if not requests:
            return stats
        cache = self._room(len(self.rows) + len(requests))
        block = self.prefixes.block
        names = [prefix_cache.block_hashes(r.tokens) for r in requests]
        reused = [prefix_cache.reusable_blocks(len(r.tokens), self.prefixes.match(n)) * block
                  for r, n in zip(requests, names, strict=True)]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault((len(request.tokens), reused[i]), []).append(i)
        evicted = self.prefixes.stats.evicted_blocks
        # the prompts' blocks are stored once every group has loaded the blocks it matched: an
        # earlier group's store into a full cache would evict them before a later group's load
        stores: list[tuple[int, list[bytes]]] = []  # (its row, its blocks' names)
        for (length, skip), members in groups.items():
            # one prefill for each distinct prompt: a request's `n` choices share theirs
            slots: dict[tuple[int, ...], int] = {}
            for i in members:
                slots.setdefault(tuple(requests[i].tokens), len(slots))
            prompt = torch.tensor(list(slots), dtype=torch.long, device=self.device)
            own: KVCache = self.model.build_cache(len(slots), length)  # type: ignore[operator]
            firsts = {slot: next(i for i in members if slots[tuple(requests[i].tokens)] == slot)
                      for slot in range(len(slots))}
            for slot, i in firsts.items():
                if skip:
                    self.prefixes.load(own, slot, names[i][: skip // block])
            own.advance(skip)
            logits = self.model.forward_step(prompt[:, skip:], own, last_only=True)[:, -1].float()  # type: ignore[operator]
            for i in members:
                slot = slots[tuple(requests[i].tokens)]
                if firsts[slot] == i:
                    stores.append((len(self.rows), names[i]))
                cache.place(len(self.rows), own, slot, length)
                generator = torch.Generator(device=self.device).manual_seed(requests[i].seed)
                self.rows.append(Row(Answer(requests[i]), generator, reused[i], began, logits[slot]))
                cache.rows = len(self.rows)
            stats.prefilled_tokens += (length - skip) * len(slots)
            stats.cached_tokens += skip * len(slots)
        for row, row_names in stores:
            self.prefixes.store(cache, row, row_names)
        stats.evicted_blocks = self.prefixes.stats.evicted_blocks - evicted
        return stats

    def choose(self) -> list[int]:
        """Each row's next token, at its own temperature and seed."""
        logits = torch.stack([row.logits for row in self.rows])[:, : tokenizer.VOCABULARY]
        chosen = logits.argmax(dim=-1).tolist()
        for i, row in enumerate(self.rows):
            request = row.answer.request
            if request.temperature > 0:
                # the best logit subtracted first: a tiny temperature divides the rest towards
                # -inf, never inf - inf (NaN), which would fail the whole batch
                probs = torch.softmax((logits[i] - logits[i].max()) / request.temperature, dim=-1)
                if request.top_p < 1:
                    probs = nucleus(probs, request.top_p)
                chosen[i] = int(torch.multinomial(probs, 1, generator=row.generator))
        return chosen

    def step(self) -> tuple[list[tuple[Request, Result]], int]:
        """One token for every row; the rows that end leave (their answers returned, and the
        blocks they complete kept in the prefix cache). Returns the answers and the prefix
        cache's evictions; `feed` then gives the other rows their tokens. Two calls, so that
        answers already made reach their clients even if the forward pass after them fails."""
        now = time.monotonic()
        chosen = self.choose()
        ended: list[int] = []
        for i, (row, token) in enumerate(zip(self.rows, chosen, strict=True)):
            if not row.chosen:
                row.answer.request.first_token_at = now
            row.chosen.append(token)
            row.answer.add(token)
            if row.answer.finished:
                ended.append(i)
        evicted = self.prefixes.stats.evicted_blocks
        results = [self._finish(i, now) for i in ended]
        for i in reversed(ended):  # the last row moves into each freed one
            self._drop(i)
        return results, self.prefixes.stats.evicted_blocks - evicted

    def feed(self) -> None:
        """The rows' last chosen tokens through the model: the logits their next ones come from."""
        if not self.rows:
            return
        assert self.cache is not None
        fed = [[row.chosen[-1]] for row in self.rows]
        tokens = torch.tensor(fed, dtype=torch.long, device=self.device)
        logits = self.model.forward_step(tokens, self.cache, last_only=True)[:, -1].float()  # type: ignore[operator]
        for i, row in enumerate(self.rows):
            row.logits = logits[i]

    def _finish(self, i: int, now: float) -> tuple[Request, Result]:
        """Row i's answer; the blocks it completes are kept, so that a conversation's next turn
        (its prompt, this answer and a new question) finds all but the question cached."""
        row = self.rows[i]
        request = row.answer.request
        request.finish_reason = row.answer.finished
        answered = request.tokens + row.chosen[:-1]  # the last token chosen was never fed back
        if len(answered) // self.prefixes.block > len(request.tokens) // self.prefixes.block:
            assert self.cache is not None
            self.prefixes.store(self.cache, i, prefix_cache.block_hashes(answered))
        tokens = row.answer.tokens
        return request, (tokenizer.decode(tokens), len(tokens), row.cached, row.began - request.arrived,
                         now - row.began)

    def _drop(self, i: int) -> None:
        assert self.cache is not None
        last = len(self.rows) - 1
        if i != last:
            self.cache.move(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.rows = len(self.rows)

    def clear(self) -> list[Request]:
        """Every row dropped (their step failed); returns their requests."""
        requests = [row.answer.request for row in self.rows]
        self.rows = []
        if self.cache is not None:
            self.cache.rows = 0
        return requests

    def run_to_end(self, requests: Sequence[Request],
                   on_answer: Callable[[Request, Result], None] | None = None) -> list[Result]:
        """`requests` admitted and decoded until every row has ended (static batching's batch);
        their results in their order."""
        self.admit(requests)
        results: dict[int, Result] = {}
        while self.rows:
            answered, _ = self.step()
            for request, result in answered:
                results[id(request)] = result
                if on_answer is not None:
                    on_answer(request, result)
            self.feed()
        return [results[id(r)] for r in requests]
