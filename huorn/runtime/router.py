"""Prompt-aware routing (`spec.routing.policy: prefix`): each completion goes to the replica most
likely to hold its prompt's prefix in its cache (huorn.runtime.prefix_cache), so a shared system
prompt or a conversation's earlier turns are prefilled once per replica rather than once per
request; a Service spreads requests at random, and with N replicas a prompt then finds its
prefix cached on one replica in N.

The choice, per request, over the replicas that answer:

1. **Bounded load.** Only replicas whose requests in flight (through this router) stay within
   `loadFactor` × the mean, the new one counted, may take it: consistent hashing with bounded
   loads (Mirrokni, Thorup and Zadimoghaddam, 2018). The least loaded replica is always within the
   bound, so no replica is ever refused work while another idles past it.
2. **Longest cached prefix.** Among those, the replica that was sent the longest run of the
   prompt's leading blocks (the names the replica's cache uses, `prefix_cache.block_hashes`),
   remembered per replica up to its cache's size, least recently sent forgotten first. A match
   counts from `MIN_MATCH_BLOCKS` blocks (or the whole prompt): prompts that share only their
   first few words ("You are a", a chat template's header) would otherwise all go to the one
   replica that saw those words first, and leave the other replicas' caches empty.
3. **Rendezvous hashing** (highest random weight) of the prompt's first `MIN_MATCH_BLOCKS` blocks
   breaks ties and places a prompt with no match, so a preamble no replica has seen goes to the
   same replica from any router, and after a restart of this one (which remembers nothing)
   requests of a preamble still meet on one replica. A prompt shorter than a block goes to the
   least loaded replica.

What a replica holds is estimated, not read: a replica evicts on its own, and a restarted replica
holds nothing. A wrong guess costs one full prefill, never a wrong answer.

Replicas come from a headless Service (`--replicas-dns host:port`, re-resolved every
`RESOLVE_SECONDS`; its A records are the ready pods) or a fixed list (`--replica URL`, for local
runs). A replica that refuses a connection is left out for `DOWN_SECONDS` and the request goes
to the next choice. The holding, retrying and time-out of requests while no replica answers are
the activator's (huorn.runtime.activator), which this module plugs into.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import socket
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import prometheus_client

from huorn.runtime import prefix_cache, prompt

RESOLVE_SECONDS = 2.0  # how stale the replica list may be: about a readiness probe's period
DOWN_SECONDS = 5.0  # a replica that refused a connection is not tried again for this long
MIN_MATCH_BLOCKS = 2  # 32 tokens: the prefill worth sending a prompt away from its hash's replica


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    sent: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # block names, LRU order
    down_until: float = 0.0


@dataclass(frozen=True)
class Choice:
    url: str
    reason: str  # "prefix" (a cached prefix), "hash" (a preamble no replica has), "short", "spill"
    matched_blocks: int


def rendezvous_weight(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


def prompt_tokens(body: bytes, is_chat: bool = False) -> list[int] | None:
    """The prompt's tokens as the replica computes them (bytes of its UTF-8; a chat's messages
    through the replica's chat template), or None for a body that is not a completion: the
    replica answers that one with its own error."""
    try:
        request = json.loads(body)
        # NB: inside the try: a lone surrogate ("\\ud800") is valid JSON and no UTF-8
        return prompt.tokens_of(request, is_chat) if isinstance(request, dict) else None
    except (ValueError, KeyError, AttributeError, RecursionError):
        return None


class PrefixRouter:
    def __init__(self, cache_tokens: int, load_factor: float, block: int = prefix_cache.BLOCK) -> None:
        if load_factor < 1:
            raise ValueError(f"spec.routing.loadFactor: {load_factor} is below 1; give 1 or more")
        self.block, self.load_factor = block, load_factor
        # what a replica keeps (prefix_cache.PrefixCache): with less than a block, nothing, and
        # a match claimed would be a lie in huorn_router_matched_tokens
        self.capacity_blocks = max(0, cache_tokens // block)
        self.replicas: dict[str, Replica] = {}
        # replicas that left the list (a readiness probe flapped, a short DNS answer) with requests
        # still in flight: their count stays right for when they come back, and until those end
        self.retired: dict[str, Replica] = {}
        r = self.registry = prometheus_client.CollectorRegistry()  # the activator serves it
        self.choices = prometheus_client.Counter(
            "huorn_router_choices", "Replicas chosen, by why: each try of a request counts (one retried "
            "after a refused connection or a cut answer counts twice).", ["reason"], registry=r)
        self.matched = prometheus_client.Counter(
            "huorn_router_matched_tokens", "Prompt tokens sent to a replica believed to hold them.",
            registry=r)
        self.known = prometheus_client.Gauge("huorn_router_replicas", "Replicas known to the router.",
                                             registry=r)

    def set_replicas(self, urls: Sequence[str]) -> None:
        """The replicas now: the ones that stay, or come back while requests sent to them are in
        flight, keep what they were sent and their load."""
        before = {**self.retired, **self.replicas}
        self.replicas = {url: before.get(url) or Replica(url) for url in sorted(set(urls))}
        self.retired = {url: r for url, r in before.items() if url not in self.replicas and r.in_flight}
        self.known.set(len(self.replicas))

    def choose(self, tokens: Sequence[int] | None, now: float | None = None) -> Choice | None:
        """The replica for one request, counted in flight until `finished`; None with no replica."""
        now = time.monotonic() if now is None else now
        up = [r for r in self.replicas.values() if r.down_until <= now] or list(self.replicas.values())
        if not up:
            return None
        total = sum(r.in_flight for r in up) + 1
        limit = math.ceil(self.load_factor * total / len(up))
        allowed = [r for r in up if r.in_flight + 1 <= limit] or up
        names = prefix_cache.block_hashes(tokens, self.block) if tokens else []
        if not names:
            best = min(allowed, key=lambda r: (r.in_flight, r.url))
            return self._take(best, names, "short", 0)

        key = names[min(len(names), MIN_MATCH_BLOCKS) - 1]
        enough = min(len(names), MIN_MATCH_BLOCKS)

        def matched(r: Replica) -> int:
            count = prefix_cache.leading(names, r.sent)
            return count if count >= enough else 0

        def rank(r: Replica) -> tuple[int, int]:
            return matched(r), rendezvous_weight(key, r.url)

        best = max(allowed, key=rank)
        favourite = max(up, key=rank)
        count = matched(best)
        reason = "spill" if favourite is not best and matched(favourite) > count else \
            ("prefix" if count else "hash")
        return self._take(best, names, reason, count)

    def _take(self, replica: Replica, names: list[bytes], reason: str, matched: int) -> Choice:
        replica.in_flight += 1
        for name in reversed(names[: self.capacity_blocks]):  # the preamble stays longest
            replica.sent[name] = None
            replica.sent.move_to_end(name)
        while len(replica.sent) > self.capacity_blocks:
            replica.sent.popitem(last=False)
        self.choices.labels(reason).inc()
        self.matched.inc(matched * self.block)
        return Choice(replica.url, reason, matched)

    def finished(self, url: str, failed: bool, now: float | None = None) -> None:
        """The request sent to `url` is over; a failed connection leaves the replica out a while,
        and forgets what it was sent (a replica that restarts comes back with an empty cache)."""
        replica = self.replicas.get(url) or self.retired.get(url)
        if replica is None:
            return
        replica.in_flight = max(0, replica.in_flight - 1)
        if not replica.in_flight and self.retired.get(url) is replica:
            del self.retired[url]
        if failed:
            replica.down_until = (time.monotonic() if now is None else now) + DOWN_SECONDS
            replica.sent.clear()


Resolver = Callable[[], Awaitable[list[str]]]


def dns_resolver(address: str) -> Resolver:
    """The replicas behind a headless Service, `host:port`: one URL per address its name resolves
    to (the ready pods); none while the name does not exist (no pod ready yet)."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address, as in a URL
        host = host[1:-1]
    if not host or not port.isdigit():
        raise ValueError(f"--replicas-dns: {address!r} is not host:port; give the headless Service's "
                         "name and the replicas' port, e.g. chat-endpoints.default.svc:8000")

    last: list[str] = []

    async def resolve() -> list[str]:
        nonlocal last
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            # no such name is the answer while no replica is ready; a failure of DNS itself
            # (a server restarting, a time-out) says nothing of the replicas: the last answer
            # stands, rather than every request held until the next resolve
            if error.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                last = []
            return list(last)
        except OSError:
            return list(last)
        last = sorted({f"http://[{i[4][0]}]:{port}" if i[0] == socket.AF_INET6 else f"http://{i[4][0]}:{port}"
                       for i in infos})
        return list(last)

    return resolve


def is_base_url(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path.strip("/") \
        and not parts.query and not parts.fragment


def static_resolver(urls: Sequence[str]) -> Resolver:
    """Fixed replicas, refused at once unless each is a replica's base URL (a bad one would be
    accepted and every request sent to it answered 500)."""
    for url in urls:
        if not is_base_url(url):
            raise ValueError(f"--replica: {url!r} is not a replica's base URL; give "
                             "http://HOST:PORT, e.g. http://127.0.0.1:8000")
    fixed = sorted({u.rstrip("/") for u in urls})

    async def resolve() -> list[str]:
        return list(fixed)

    return resolve
