"""Continuous batching for a serving replica: the requests in flight are decoded together, each at
its own position, and one joins or leaves between two decoding steps (Orca's iteration-level
scheduling, what vLLM and TGI do).

Before, a batch was the oldest request and the waiting ones of its prompt length, decoded to its
longest answer before the next batch began: a request that arrived a step after a batch started
waited for all of it, and prompts of other lengths never shared a step. Here the running batch is
one `RaggedKVCache` whose first `rows` rows are the requests in flight. A request is admitted
between two steps (`admit`): its prompt is prefilled in a cache of its own (with the prompts of
its length that skip as many cached blocks), up to `serving.prefillChunkTokens` prompt tokens
before each step (`prefill`, chunked prefill as Sarathi-Serve and vLLM do it: a long prompt
holds the running answers for a chunk a step, not for its whole prefill), and placed in a free
row once whole; a step (`step`) chooses a token for every row, answers the rows that end, and
`feed` gives the others' tokens to the model in one forward pass. A row that ends is replaced by
the last one, so a step never computes a free row.

The model runs without autograd (`prefill` and `feed` under no_grad; the server's model has no
parameter that asks for gradients): with it, every step's write into the batch's KV cache chained
that step's graph onto the cache's, so every activation since the replica started stayed alive
(a 368M-parameter model on a GPU ran out of its 80 GB within a minute of traffic).

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
from huorn.runtime import decode_graphs, prefix_cache
from huorn.runtime.data import tokenizer
from huorn.runtime.logprobs import TokenLogprob, measure, measure_prompt

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
    stop: tuple[bytes, ...] = ()  # the answer ends before the first of these it would contain
    finish_reason: str | None = None  # "stop" or "length", once decoded
    chat: bool = False  # asked through the chat API: answered in its shape
    # Its client went (a streamed answer's connection closed): its row stops choosing tokens.
    abandoned: bool = False
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    index: int = 0  # which of its HTTP request's `n` choices it is (their stream is shared)
    # With `logprobs`: how many likeliest alternatives to report beside each chosen token's
    # log-probability (0 for none); its answer's are in `answer_logprobs` once decoded.
    logprobs: int | None = None
    answer_logprobs: list[TokenLogprob] | None = None
    # OpenAI's `echo`: the answer's text begins with the prompt's, and with `logprobs` its
    # log-probabilities begin with the prompt's (`prompt_logprobs`, measured as it is prefilled;
    # the first token has none). How evaluation harnesses score a text: echo, logprobs, and
    # max_tokens 0 (no answer at all) or 1.
    echo: bool = False
    prompt_logprobs: list[TokenLogprob] | None = None
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked

    def add(self, token: int, measured: TokenLogprob | None = None) -> None:
        if self.request.abandoned:  # nobody reads the rest: its row may leave the batch
            self.finished = self.finished or "abandoned"
        if self.finished:
            return
        self.tokens.append(token)
        if measured is not None:
            self.logprobs.append(measured)
        # every match ends at the newest byte (an earlier one would have ended the answer), so the
        # longest starts first: the answer ends before it, whatever the order the stops came in
        matched = [len(s) for s in self.request.stop if bytes(self.tokens[-len(s):]) == s]
        if matched:
            del self.tokens[-max(matched):]
            del self.logprobs[len(self.tokens):]
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
        for i in range(self.streamed, end):
            event = (request.index, self.tokens[i], self.logprobs[i] if self.logprobs else None)
            request.loop.call_soon_threadsafe(request.stream.put_nowait, event)
        self.streamed = max(self.streamed, end)


def nucleus(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """`probs` (a row, or rows with a `top_p` each as a [rows, 1] tensor) kept on the most likely
    tokens whose mass first reaches top_p (the top one at least), the rest zeroed: multinomial
    sampling renormalises (Holtzman et al., 2020)."""
    ordered, order = probs.sort(dim=-1, descending=True)
    keep = ordered.cumsum(-1) - ordered < top_p
    keep[..., 0] = True
    return torch.zeros_like(probs).scatter(-1, order, ordered * keep)


def sample(logits: torch.Tensor, requests: Sequence[Request],
           generators: Sequence[torch.Generator]) -> list[int]:
    """One token for each row of `logits` at its request's temperature and top_p, drawn with
    its own generator, on the CPU whatever the model's device. The rows' distributions are
    computed together and cross to the host once: a row at a time cost a softmax, a sort and a
    device sync per row per step (16 sampled rows: 0.76 ms a step against 0.35 ms, on CPU)."""
    # at least float32's smallest normal: a temperature below it (1e-50, which validation takes)
    # was 0 in the tensor, and the best logit's 0 / 0 a NaN that failed every row of the batch
    temperature = torch.tensor([r.temperature for r in requests], device=logits.device)[:, None]
    temperature = temperature.clamp_min(torch.finfo(torch.float32).tiny)
    # the best logit subtracted first: a tiny temperature divides the rest towards -inf, never
    # inf - inf (NaN), which would fail the whole batch
    probs = torch.softmax((logits - logits.max(dim=-1, keepdim=True).values) / temperature, dim=-1)
    narrowed = [j for j, r in enumerate(requests) if r.top_p < 1]
    if narrowed:
        top_p = torch.tensor([requests[j].top_p for j in narrowed], device=logits.device)[:, None]
        probs[narrowed] = nucleus(probs[narrowed], top_p)
    probs = probs.cpu()
    return [int(torch.multinomial(probs[j], 1, generator=g)) for j, g in enumerate(generators)]


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
    chosen_at: float = 0.0  # when its last token was chosen


@dataclass
class AdmitStats:
    """What one admission did, for the server's metrics."""

    cached_tokens: int = 0
    prefilled_tokens: int = 0


@dataclass
class Prefill:
    """Distinct prompts that skip as many cached blocks, prefilled together in a cache of their
    own, a chunk at a time; the requests that share each (a request's `n` choices share theirs).
    Prompts of one length, or, padded (`RunningBatch`'s `pad_prefills`), of any: padding goes
    after a prompt, where causal attention keeps it out of every real position, and only a
    prompt's own positions leave this cache."""

    prompts: torch.Tensor  # [distinct prompts, the longest's length], padded with 0
    cache: KVCache  # theirs: its length is how far the prefill has come
    requests: list[tuple[Request, int, int]]  # (request, its prompt's slot, tokens from the prefix cache)
    names: list[list[bytes]]  # each slot's block names, stored in the prefix cache once whole
    began: float
    lengths: list[int]  # each slot's own length
    # each slot's next-token logits [V], from the chunk that holds its last position
    logits: list[torch.Tensor | None] = field(default_factory=list)
    # echoed prompts' log-probabilities, measured chunk by chunk (their groups skip no cached
    # block: a cached block has no logits), with this many alternatives; None: not asked
    scores: list[list[TokenLogprob]] | None = None
    alternatives: int = 0

    @property
    def remaining(self) -> int:
        return self.prompts.shape[1] - self.cache.length


class RunningBatch:
    def __init__(self, model: torch.nn.Module, prefixes: prefix_cache.PrefixCache, max_length: int,
                 max_rows: int | None = None, fixed_steps: bool | None = None,
                 pad_prefills: bool | None = None) -> None:
        """With `max_rows` (a server's maxBatch) the batch's whole KV cache is allocated now, as
        vLLM and TGI allocate theirs at start: a replica whose batch does not fit fails before it
        is ready, and the cache never grows mid-traffic (growing copies it, which held the
        running answers for up to 420 ms on CPU). Without, it grows by doubling as rows join.

        `fixed_steps` (with `max_rows`): decoding steps of fixed shapes, captured as CUDA graphs
        where the model allows (huorn.runtime.decode_graphs); None: where it does, True: always
        (eagerly where it does not), False: never.

        `pad_prefills`: the joining prompts of different lengths are prefilled together, padded
        to the longest, rather than one forward pass per length. On a GPU (the default there) a
        forward pass costs its kernel launches more than its tokens, and one per length made
        the prefills what bounded a replica whose steps replay as CUDA graphs; on a CPU (off by
        default) the padding costs its tokens."""
        self.model = model
        self.prefixes = prefixes
        self.max_length = max_length
        self.device = next(model.parameters()).device
        self.pad_prefills = self.device.type == "cuda" if pad_prefills is None else pad_prefills
        self.rows: list[Row] = []
        self.prefilling: list[Prefill] = []  # admitted, not yet whole, oldest first
        # answered as their prefill ended (max_tokens 0: an echoed prompt scored, nothing
        # decoded), not yet taken by `take_early`
        self.early: list[tuple[Request, Result]] = []
        # seconds between two tokens of one row, as chosen since the server last took them: what
        # a streaming client waits between two events (the server's inter-token histogram)
        self.token_gaps: list[float] = []
        # seconds from arrival to each row's first token, as chosen since the server last took
        # them: read then, not when the answer ends, so a guard on time to first token sees a slow
        # start as it happens rather than an answer's length later
        self.first_token_waits: list[float] = []
        self.cache: RaggedKVCache | None = None
        self.graphs: decode_graphs.DecodeGraphs | None = None
        if max_rows is not None:
            cache = self._room(max_rows)
            capturable = decode_graphs.capturable(model)
            if fixed_steps or (fixed_steps is None and capturable):
                self.graphs = decode_graphs.DecodeGraphs(model, cache, max_rows, capture=capturable)

    def __len__(self) -> int:
        return len(self.rows)

    def waiting(self) -> int:
        """Requests admitted whose prompts are still being prefilled: rows promised to them."""
        return sum(len(p.requests) for p in self.prefilling)

    def _room(self, rows: int) -> RaggedKVCache:
        """A cache for at least `rows` rows (made, or grown by doubling)."""
        if self.cache is None:
            self.cache = self.model.build_ragged_cache(max(1, rows), self.max_length)  # type: ignore[operator]
        if rows > self.cache.capacity:
            self.cache.grow(max(rows, 2 * self.cache.capacity))
        return self.cache

    def admit(self, requests: Sequence[Request]) -> AdmitStats:
        """Take `requests` in: each prompt's leading blocks held in the prefix cache are loaded now
        (every one before any prompt's blocks are stored, which could evict them from a full
        cache), the rest is left to `prefill`. Prompts that skip as many blocks are prefilled
        together (of one length each, unless `pad_prefills`; echoed prompts scored, always);
        identical prompts once."""
        began = time.monotonic()
        stats = AdmitStats()
        if not requests:
            return stats
        self._room(len(self.rows) + self.waiting() + len(requests))
        block = self.prefixes.block
        names = [prefix_cache.block_hashes(r.tokens) for r in requests]
        scored = [r.echo and r.logprobs is not None for r in requests]
        reused = [0 if score else prefix_cache.reusable_blocks(len(r.tokens), self.prefixes.match(n)) * block
                  for r, n, score in zip(requests, names, scored, strict=True)]
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for i, request in enumerate(requests):
            # a scored prompt's log-probabilities are read at every position: never padded
            shape = 0 if self.pad_prefills and not scored[i] else len(request.tokens)
            groups.setdefault((shape, reused[i], scored[i]), []).append(i)
        for (_, skip, score), members in groups.items():
            slots: dict[tuple[int, ...], int] = {}
            for i in members:
                slots.setdefault(tuple(requests[i].tokens), len(slots))
            lengths = [len(prompt) for prompt in slots]
            length = max(lengths)
            padded = [[*prompt, *[0] * (length - len(prompt))] for prompt in slots]
            own: KVCache = self.model.build_cache(len(slots), length)  # type: ignore[operator]
            firsts = {slots[tuple(requests[i].tokens)]: i for i in reversed(members)}
            for slot, i in firsts.items():
                if skip:
                    self.prefixes.load(own, slot, names[i][: skip // block])
            own.advance(skip)
            self.prefilling.append(Prefill(
                torch.tensor(padded, dtype=torch.long, device=self.device), own,
                [(requests[i], slots[tuple(requests[i].tokens)], reused[i]) for i in members],
                [names[firsts[slot]] for slot in range(len(slots))], began, lengths,
                [None] * len(slots), scores=[[] for _ in slots] if score else None,
                alternatives=max((requests[i].logprobs or 0 for i in members), default=0)))
            stats.prefilled_tokens += sum(n - skip for n in lengths)
            stats.cached_tokens += skip * len(slots)
        return stats

    @torch.no_grad()
    def prefill(self, budget: int = 0) -> None:
        """Prefill the admitted prompts, oldest first, up to `budget` prompt tokens (0: all of
        them); the prompts made whole get their rows."""
        spent = 0
        while self.prefilling and (budget == 0 or spent < budget):
            group = self.prefilling[0]
            width = group.prompts.shape[0]
            left = group.remaining
            chunk = left if budget == 0 else min(left, max(1, (budget - spent) // width))
            start = group.cache.length
            # every position's logits where a prompt is scored or one of them ends inside the
            # chunk (padded prompts), else the last position's only
            ending = [slot for slot, n in enumerate(group.lengths) if start < n <= start + chunk]
            whole = group.scores is not None or any(group.lengths[slot] < start + chunk for slot in ending)
            out = self.model.forward_step(  # type: ignore[operator]
                group.prompts[:, start:start + chunk], group.cache, last_only=not whole)
            if group.scores is not None:
                measured = measure_prompt(out[..., : tokenizer.VOCABULARY].float(), group.prompts, start,
                                          group.alternatives)
                for slot, entries in enumerate(measured):
                    group.scores[slot] += entries
            for slot in ending:  # its last position's
                group.logits[slot] = out[slot, group.lengths[slot] - 1 - start if whole else -1].float()
            spent += chunk * width
            if group.remaining == 0:
                # seated before it leaves `prefilling`: if seating fails partway, `clear` still
                # finds the requests not yet in a row (and those in one only once)
                self._seat(group)
                self.prefilling.pop(0)

    def _seat(self, group: Prefill) -> None:
        """A whole prefill's requests into rows; its prompts' blocks into the prefix cache."""
        assert self.cache is not None
        for request, slot, cached in group.requests:
            length = group.lengths[slot]
            if group.scores is not None:
                n = request.logprobs or 0
                request.prompt_logprobs = [TokenLogprob(request.tokens[0], None, None)] + [
                    TokenLogprob(e.token, e.logprob, (e.top or ())[:n]) for e in group.scores[slot]]
            if request.max_tokens == 0:  # scored, not answered: no row
                now = time.monotonic()
                request.finish_reason = "length"
                request.answer_logprobs = [] if request.logprobs is not None else None
                text = tokenizer.decode(request.tokens) if request.echo else ""
                seconds = (group.began - request.arrived, now - group.began)
                self.early.append((request, (text, 0, cached, *seconds)))
                continue
            self.cache.place(len(self.rows), group.cache, slot, length)
            generator = torch.Generator().manual_seed(request.seed)  # sampling draws on the CPU
            logits = group.logits[slot]
            assert logits is not None  # the prefill is whole: every slot's last position was in a chunk
            self.rows.append(Row(Answer(request), generator, cached, group.began, logits))
            self.cache.rows = len(self.rows)
        for slot, slot_names in enumerate(group.names):
            self.prefixes.store(group.cache, slot, slot_names)

    def take_early(self) -> list[tuple[Request, Result]]:
        """The requests answered as their prefill ended (`early`), once each."""
        early, self.early = self.early, []
        return early

    def choose(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each row's next token, at its own temperature and seed; its log-probabilities for
        the rows whose requests ask for them."""
        logits = torch.stack([row.logits for row in self.rows])[:, : tokenizer.VOCABULARY]
        chosen = logits.argmax(dim=-1).tolist()
        hot = [i for i, row in enumerate(self.rows) if row.answer.request.temperature > 0]
        if hot:
            drawn = sample(logits[hot], [self.rows[i].answer.request for i in hot],
                           [self.rows[i].generator for i in hot])
            for i, token in zip(hot, drawn, strict=True):
                chosen[i] = token
        measured: list[TokenLogprob | None] = [None] * len(self.rows)
        asking = [i for i, row in enumerate(self.rows) if row.answer.request.logprobs is not None]
        if asking:
            found = measure(logits[asking], [chosen[i] for i in asking],
                            [self.rows[i].answer.request.logprobs or 0 for i in asking])
            for i, entry in zip(asking, found, strict=True):
                measured[i] = entry
        return chosen, measured

    def step(self) -> list[tuple[Request, Result]]:
        """One token for every row; the rows that end leave (their answers returned, and the
        blocks they complete kept in the prefix cache); `feed` then gives the other rows their
        tokens. Two calls, so that answers already made reach their clients even if the forward
        pass after them fails."""
        now = time.monotonic()
        chosen, measured = self.choose()
        ended: list[int] = []
        for i, (row, token) in enumerate(zip(self.rows, chosen, strict=True)):
            if not row.chosen:
                self.first_token_waits.append(now - row.answer.request.arrived)
            else:
                self.token_gaps.append(now - row.chosen_at)
            row.chosen_at = now
            row.chosen.append(token)
            row.answer.add(token, measured[i])
            if row.answer.finished:
                ended.append(i)
        results = [self._finish(i, now) for i in ended]
        for i in reversed(ended):  # the last row moves into each freed one
            self._drop(i)
        return results

    @torch.no_grad()
    def feed(self) -> None:
        """The rows' last chosen tokens through the model: the logits their next ones come from."""
        if not self.rows:
            return
        assert self.cache is not None
        # a batch grown past maxBatch (run_to_end) has no bucket: it steps eagerly over its rows
        if self.graphs is not None and len(self.rows) <= self.graphs.buckets[-1]:
            logits = self.graphs.run([row.chosen[-1] for row in self.rows])
        else:
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
        if request.logprobs is not None:
            request.answer_logprobs = row.answer.logprobs
        answered = request.tokens + row.chosen[:-1]  # the last token chosen was never fed back
        if len(answered) // self.prefixes.block > len(request.tokens) // self.prefixes.block:
            assert self.cache is not None
            self.prefixes.store(self.cache, i, prefix_cache.block_hashes(answered))
        tokens = row.answer.tokens
        text = tokenizer.decode(request.tokens + tokens if request.echo else tokens)
        return request, (text, len(tokens), row.cached, row.began - request.arrived,
                         now - row.began)

    def _drop(self, i: int) -> None:
        assert self.cache is not None
        last = len(self.rows) - 1
        if i != last:
            self.cache.move(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.free(last)
        self.cache.rows = len(self.rows)

    def clear(self) -> list[Request]:
        """Every row and prefill dropped (their step failed); returns their requests."""
        requests = [row.answer.request for row in self.rows]
        seated = {id(r) for r in requests}
        requests += [request for group in self.prefilling for request, _, _ in group.requests
                     if id(request) not in seated]
        requests += [request for request, _ in self.early]
        self.rows, self.prefilling, self.early = [], [], []
        if self.cache is not None:
            for row in range(self.cache.rows):
                self.cache.free(row)
            self.cache.rows = 0
        return requests

    def run_to_end(self, requests: Sequence[Request],
                   on_answer: Callable[[Request, Result], None] | None = None) -> list[Result]:
        """`requests` admitted and decoded until every row has ended (static batching's batch);
        their results in their order."""
        self.admit(requests)
        self.prefill()
        results: dict[int, Result] = {}
        for request, result in self.take_early():
            results[id(request)] = result
            if on_answer is not None:
                on_answer(request, result)
        while self.rows:
            answered = self.step()
            for request, result in answered:
                results[id(request)] = result
                if on_answer is not None:
                    on_answer(request, result)
            self.token_gaps.clear()  # no server reads them here
            self.first_token_waits.clear()
            self.feed()
        return [results[id(r)] for r in requests]
