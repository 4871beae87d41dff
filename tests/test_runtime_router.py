"""The prefix router: a preamble sticks to one replica, the longest cached prefix wins, no replica
is ever loaded past loadFactor × the mean, a restarted router sends a cold preamble where the old
one did, a replica that refuses connections is left out; and, as real processes, the router in
front of two serving replicas answers every prompt after a preamble's first from the cache, and
goes on answering when one replica goes away."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kube import serving

from huorn.api import inference
from huorn.runtime import activator, chat, prefix_cache, router

REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
PREAMBLES = [f"System prompt number {i}: be brief, be right, cite nothing.\n" for i in range(30)]


def _router(load_factor: float = 1.25, urls: list[str] = REPLICAS) -> router.PrefixRouter:
    r = router.PrefixRouter(cache_tokens=4096, load_factor=load_factor)
    r.set_replicas(urls)
    return r


def _tokens(text: str) -> list[int]:
    return list(text.encode())


def _send(r: router.PrefixRouter, text: str, now: float = 0.0) -> router.Choice:
    choice = r.choose(_tokens(text), now=now)
    assert choice is not None
    return choice


def test_a_preamble_sticks_to_one_replica_and_preambles_spread_over_all() -> None:
    r = _router()
    homes = {}
    for preamble in PREAMBLES:
        choices = set()
        for q in range(4):
            choices.add(url := _send(r, preamble + f"Q{q}?").url)
            r.finished(url, failed=False)
        assert len(choices) == 1  # sent one at a time, nothing in flight: always its home
        homes[preamble] = choices.pop()
    spread = Counter(homes.values())
    assert set(spread) == set(REPLICAS) and min(spread.values()) >= 5


def test_the_replica_sent_the_longest_prefix_wins() -> None:
    r = _router(urls=REPLICAS[:2])
    base = PREAMBLES[0] + "First turn: tell me about rivers.\n"  # 4 whole blocks
    home = _send(r, base).url
    r.finished(home, failed=False)
    other = next(u for u in REPLICAS[:2] if u != home)
    # the same first two blocks, then a branch that only `other` was sent (it was given it by hand,
    # as a spill would): a prompt continuing the branch goes there, past the preamble's home
    branch = PREAMBLES[0] + "Another turn: tell me about lakes..\n"
    r.replicas[other].sent.update((name, None) for name in prefix_cache.block_hashes(_tokens(branch)))
    choice = _send(r, branch + "Second turn: and seas?")
    assert choice.url == other and choice.reason == "prefix"
    assert choice.matched_blocks == len(prefix_cache.block_hashes(_tokens(branch)))


@settings(max_examples=60, deadline=None)
@given(load_factor=st.sampled_from([1.0, 1.25, 2.0]), replicas=st.integers(1, 5),
       ops=st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=80))
def test_no_replica_is_ever_loaded_past_the_bound(load_factor: float, replicas: int,
                                                  ops: list[tuple[int, bool]]) -> None:
    """Random arrivals (mostly of one hot preamble) and completions: after every choice the chosen
    replica holds at most ceil(loadFactor × in-flight / replicas)."""
    r = _router(load_factor, [f"http://10.0.1.{i}:8000" for i in range(replicas)])
    sent: list[str] = []
    for preamble, arrive in ops:
        if arrive or not sent:
            choice = _send(r, PREAMBLES[preamble % 2] + "Q?")
            sent.append(choice.url)
            total = sum(x.in_flight for x in r.replicas.values())
            assert r.replicas[choice.url].in_flight <= math.ceil(load_factor * total / replicas)
        else:
            r.finished(sent.pop(random.Random(len(sent)).randrange(len(sent))), failed=False)


def test_a_hot_preamble_spills_to_other_replicas_under_load() -> None:
    r = _router(load_factor=1.25)
    choices = [_send(r, PREAMBLES[3] + f"Q{i}?") for i in range(9)]  # none finishes
    counts = Counter(c.url for c in choices)
    assert max(counts.values()) <= math.ceil(1.25 * 9 / 3) and len(counts) == 3
    assert {c.reason for c in choices[1:]} <= {"prefix", "spill", "hash"}
    assert any(c.reason == "spill" for c in choices)


def test_a_restarted_router_sends_a_cold_preamble_where_the_old_one_did() -> None:
    before = {p: _send(_router(), p + "Q?").url for p in PREAMBLES}
    after = {p: _send(_router(), p + "Q?").url for p in PREAMBLES}
    assert before == after
    # one replica fewer: only the preambles whose home went away move (rendezvous hashing)
    smaller = {p: _send(_router(urls=REPLICAS[:2]), p + "Q?").url for p in PREAMBLES}
    assert all(smaller[p] == before[p] for p in PREAMBLES if before[p] in REPLICAS[:2])


def test_a_refusing_replica_is_left_out_for_a_while_and_forgets_what_it_was_sent() -> None:
    r = _router(urls=REPLICAS[:2])
    home = _send(r, PREAMBLES[5] + "Q?", now=100.0).url
    r.finished(home, failed=True, now=100.0)
    assert not r.replicas[home].sent
    elsewhere = _send(r, PREAMBLES[5] + "Q?", now=101.0)
    assert elsewhere.url != home
    r.finished(elsewhere.url, failed=True, now=101.0)
    # every replica down: the router still answers with one (a refused connection is retried)
    assert _send(r, PREAMBLES[5] + "Q?", now=102.0).url in REPLICAS[:2]
    assert _send(r, PREAMBLES[6] + "Q?", now=100.0 + router.DOWN_SECONDS + 1).url in REPLICAS[:2]


def test_replicas_that_stay_keep_their_load_and_what_they_were_sent() -> None:
    r = _router()
    choice = _send(r, PREAMBLES[1] + "Q?")
    r.set_replicas([choice.url, "http://10.0.0.9:8000"])
    assert r.replicas[choice.url].in_flight == 1 and r.replicas[choice.url].sent
    assert _router(urls=[]).choose(_tokens(PREAMBLES[1])) is None


def test_short_prompts_go_to_the_least_loaded_replica() -> None:
    r = _router()
    choices = [_send(r, "hi") for _ in range(3)]
    assert sorted(c.url for c in choices) == REPLICAS and {c.reason for c in choices} == {"short"}


def test_bad_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.routing\.loadFactor"):
        router.PrefixRouter(1024, 0.5)
    with pytest.raises(ValueError, match="loadFactor"):
        inference.Routing.model_validate({"loadFactor": 0.5})
    with pytest.raises(ValueError, match="policy"):
        inference.Routing.model_validate({"policy": "round-robin"})
    with pytest.raises(ValueError, match="--replicas-dns"):
        router.dns_resolver("no-port-here")


def test_dns_gives_one_replica_per_address_and_none_for_an_unknown_name() -> None:
    assert "http://127.0.0.1:8000" in asyncio.run(router.dns_resolver("localhost:8000")())
    assert asyncio.run(router.dns_resolver("no-such-service.invalid:8000")()) == []



def test_a_replica_that_leaves_and_comes_back_keeps_its_requests_in_flight() -> None:
    """A readiness probe that flaps, or a short DNS answer, takes a replica out of the list for a
    resolve or two while requests sent to it run on: back, it is still loaded by them."""
    r = _router()
    home = _send(r, PREAMBLES[2] + "Q?").url
    r.set_replicas([u for u in REPLICAS if u != home])
    r.set_replicas(REPLICAS)
    assert r.replicas[home].in_flight == 1 and r.replicas[home].sent
    r.set_replicas([u for u in REPLICAS if u != home])
    r.finished(home, failed=False)  # ended while out of the list
    r.set_replicas(REPLICAS)
    assert r.replicas[home].in_flight == 0 and not r.retired


def test_a_cache_smaller_than_a_block_claims_no_cached_prefix() -> None:
    """prefixCacheTokens under 16 (or 0): replicas keep nothing, so no match is claimed."""
    r = router.PrefixRouter(cache_tokens=8, load_factor=1.25)
    r.set_replicas(REPLICAS)
    prompt = PREAMBLES[0][:20]  # one whole block
    for _ in range(2):
        choice = _send(r, prompt)
        r.finished(choice.url, failed=False)
    assert choice.reason == "hash" and choice.matched_blocks == 0
    assert 'huorn_router_matched_tokens_total 0.0' in prometheus_client.generate_latest(r.registry).decode()


def test_a_body_the_router_cannot_read_goes_to_a_replica_to_refuse() -> None:
    assert router.prompt_tokens(b'{"prompt": "\\ud800 lone surrogate"}') is None
    assert router.prompt_tokens(b"[" * 100_000) is None
    assert router.prompt_tokens(b'{"prompt": 3}') is None and router.prompt_tokens(b"not json") is None
    assert router.prompt_tokens('{"prompt": "é"}'.encode()) == [0xC3, 0xA9]
    # token ids, as the replica reads them; no object places like a bad body
    assert router.prompt_tokens(b'{"prompt": [195, 169]}') == [0xC3, 0xA9]
    assert router.prompt_tokens(b"[1]") is None
    # several prompts (an evaluation harness's batch) are placed by the first
    assert router.prompt_tokens(b'{"prompt": ["ab", "c"]}') == [97, 98]
    assert router.prompt_tokens(b'{"prompt": ["ab", ""]}') is None  # the replica refuses it
    assert router.prompt_tokens(b'{"prompt": ["ab"]}') == [97, 98]  # a list of one prompt is that one
    assert router.prompt_tokens(b'{"max_tokens": 3}') is None


def test_replica_urls_are_checked_before_serving(tmp_path: Path) -> None:
    for bad in ("127.0.0.1:8000", "http://127.0.0.1:8000/v1", "http://:8000", "http://h:port"):
        with pytest.raises(ValueError, match="--replica"):
            router.static_resolver([bad])
    same = ["http://127.0.0.1:8000/", "http://127.0.0.1:8000", "http://[::1]:8000"]
    assert asyncio.run(router.static_resolver(same)()) == ["http://127.0.0.1:8000", "http://[::1]:8000"]
    config = tmp_path / "config.json"
    spec = serving.make_inference_job("chat", "serve", routing={"policy": "prefix"})["spec"]
    config.write_text(json.dumps({"jobName": "chat", "runDir": str(tmp_path), "spec": spec}))
    assert activator.main(["--config", str(config), "--replica", "127.0.0.1:8000"]) == 2


def test_a_router_whose_port_is_taken_exits_2_naming_the_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = serving.make_inference_job("chat", "serve", routing={"policy": "prefix"})["spec"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "config.json"
        config.write_text(json.dumps({"jobName": "chat", "runDir": str(tmp_path), "spec": spec,
                                      "host": "127.0.0.1", "port": port}))
        assert activator.main(["--config", str(config), "--replica", "http://127.0.0.1:1"]) == 2
    error = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in error and "0 for a free one" in error


def test_dns_takes_an_ipv6_address_in_brackets() -> None:
    assert asyncio.run(router.dns_resolver("[::1]:8000")()) == ["http://[::1]:8000"]



def test_a_failure_of_dns_itself_keeps_the_last_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DNS server restarting (EAI_AGAIN) says nothing of the replicas: forgetting them would
    hold every request until the next resolve; a name that does not exist (no replica ready) is
    the empty list."""
    answers: list[object] = [[(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 8000))],
                             socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
                             socket.gaierror(socket.EAI_NONAME, "Name or service not known")]

    async def getaddrinfo(self: object, *args: object, **kwargs: object) -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)
    resolve = router.dns_resolver("chat-endpoints.team.svc:8000")

    async def three() -> list[list[str]]:
        return [await resolve() for _ in range(3)]

    assert asyncio.run(three()) == [["http://10.0.0.1:8000"], ["http://10.0.0.1:8000"], []]


# ------------------------------------------------------------------ real processes
@pytest.fixture()
def two_replicas(tmp_path: Path) -> Iterator[serving.Replicas]:
    r = serving.Replicas(serving.save_tiny_model(tmp_path / "ckpt"), tmp_path / "run")
    r.start("127.0.0.2")
    r.start("127.0.0.3")
    yield r
    r.close()


def _metric(url: str, name: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        return "\n".join(line for line in answer.read().decode().splitlines() if line.startswith(name))


def test_the_router_sends_each_preamble_to_its_cache_and_survives_a_replica_going(
        tmp_path: Path, two_replicas: serving.Replicas) -> None:
    urls = tuple(f"http://127.0.0.{i}:{two_replicas.port}" for i in (2, 3))
    front = serving.Activator(tmp_path / "router", "127.0.0.6", None, replicas=urls)
    try:
        # two preambles whose home is each replica (the homes hash the replicas' URLs, whose port
        # is picked at random): a fresh router places a cold preamble as the router process does
        homes = {p: _send(_router(urls=list(urls)), p + "Q: 1+1?\nA:").url for p in PREAMBLES}
        chosen = [p for u in urls for p in [p for p in PREAMBLES if homes[p] == u][:2]]
        cached = []
        for preamble in chosen:
            for question in ("Q: 1+1?\nA:", "Q: 2+2?\nA:", "Q: 3+3?\nA:"):
                status, body = serving.complete(front.url, preamble + question, max_tokens=2)
                assert status == 200, body
                cached.append(body["cached_tokens"])
        # each preamble's first prompt is prefilled in full (but for the first block, which the
        # preambles share: "System prompt nu"), the next two from the cache
        assert all(c <= 16 for c in cached[0::3]) and all(c >= 48 for i, c in enumerate(cached) if i % 3)
        served = [_metric(u, "huorn_serve_requests_total") for u in urls]
        assert all('outcome="ok"' in s for s in served)  # both replicas took preambles
        assert 'huorn_router_choices_total{reason="prefix"} 8.0' in _metric(front.url, "huorn_router")
        two_replicas.stop("127.0.0.2")
        answers = [serving.complete(front.url, p + "Q: 4+4?\nA:", max_tokens=2) for p in chosen]
        assert all(status == 200 for status, _ in answers)
    finally:
        front.close()


def test_a_chat_is_routed_by_the_prompt_its_replica_will_render() -> None:
    messages = [{"role": "system", "content": PREAMBLES[0]}, {"role": "user", "content": "Hi?"}]
    body = json.dumps({"messages": messages}).encode()
    assert router.prompt_tokens(body, is_chat=True) == list(chat.render(messages).encode())
    assert router.prompt_tokens(body) is None  # not a completion's body
    bad = json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode()
    assert router.prompt_tokens(bad, is_chat=True) is None  # the replica refuses it, naming the field
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: give a string"):
        chat.render([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match=r"^messages: give a non-empty list"):
        chat.render([])
