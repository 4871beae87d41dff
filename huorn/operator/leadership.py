"""Whether this operator leads its kopf peering, for the work kopf does not pause.

kopf pauses a standby replica's watches, timers and daemons, but not the tasks an operator starts
itself: the mirror resync and the woken reconciles (`ctx.wake` and its timers, which also fire on
a leader demoted during a rollout). Those ask here first, so a standby never writes. The answer
follows kopf's own rule on the peering object: a replica leads when it has announced itself and
no live peer has its priority or a higher one (kopf pauses every peer of a shared highest
priority). It is read at most once per `cache_seconds`, so a burst of wakes costs one GET.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class PeeringReader(Protocol):
    async def get_peering(self, name: str) -> dict[str, Any] | None: ...


def leads_in(peers: Mapping[str, Any], identity: str, priority: int, now: datetime.datetime) -> bool:
    """kopf's rule over a ClusterKopfPeering's status ({identity: {priority, lifetime, lastseen}})."""
    if identity not in peers:
        return False  # not announced yet: kopf keeps this replica paused until it is
    for other, peer in peers.items():
        if other == identity or not isinstance(peer, Mapping):
            continue
        seen = datetime.datetime.fromisoformat(str(peer.get("lastseen")))
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        if seen + datetime.timedelta(seconds=int(peer.get("lifetime", 60))) <= now:
            continue  # a dead peer, which kopf ignores too
        if int(peer.get("priority", 0)) >= priority:
            return False
    return True


@dataclass
class Leadership:
    peering: str
    identity: str
    priority: int
    cache_seconds: float = 2.0
    _checked: float = field(default=-math.inf, repr=False)
    _leads: bool = field(default=False, repr=False)

    async def leads(self, client: PeeringReader) -> bool:
        now = asyncio.get_running_loop().time()
        if now - self._checked < self.cache_seconds:
            return self._leads
        try:
            body = await client.get_peering(self.peering)
        except Exception as error:  # an unreadable object is no licence to act
            logger.warning("cannot read peering %r (%s): acting as a standby until it can be read",
                           self.peering, error)
            return False
        peers = (body or {}).get("status") or {}
        leads = leads_in(peers, self.identity, self.priority, datetime.datetime.now(datetime.UTC))
        if leads != self._leads:
            logger.info("peering %r: this operator (%s) %s", self.peering, self.identity,
                        "leads" if leads else "is a standby")
        self._leads, self._checked = leads, now
        return leads
