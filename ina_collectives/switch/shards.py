"""Several aggregators in one ``ina-switch`` process: a shard per core, each its own UDP
port, socket, slots and compiled loop (in a thread: the loop runs without the GIL).

A job stripes each call across the shards' ports as it would across separate switches
(INA_SWITCH lists them; docs/striping.md): no packet is steered, no state is shared, so
the shards scale with the cores. Fault settings sent to any shard apply to all of them,
and the status line adds the shards' counters up.
"""
from __future__ import annotations

import logging
import threading

from .server import SoftwareSwitch, status_text

log = logging.getLogger("ina_collectives.switch")


class Shards:
    """``count`` SoftwareSwitch objects on ports ``port`` .. ``port + count - 1`` (each a
    free one if ``port`` is 0). ``each``: options of shard i on top of ``options`` (a
    tree's leaf: shard t sends up to root t), and then the shards serve separate trees:
    their replies do not list each other's ports (a job does not stripe across them by
    one address)."""

    STOP_BOUND = 5.0  # seconds a shard's loop may take to stop

    def __init__(self, count: int, host: str, port: int,
                 each: list[dict[str, object]] | None = None, **options: object):
        if count < 1:
            raise ValueError(f"a switch needs one shard or more, got {count}")
        self.shards: list[SoftwareSwitch] = []
        try:
            for i in range(count):
                try:
                    self.shards.append(SoftwareSwitch(host, port + i if port else 0,
                                                      **options, **(each or [{}] * count)[i]))
                except OSError as exc:
                    raise OSError(exc.errno, f"shard {i} of {count}, port "
                                  f"{port + i if port else 0}: {exc.strerror}") from None
        except BaseException:
            for shard in self.shards:
                shard.sock.close()
            raise
        ports = [shard.address[1] for shard in self.shards]
        for shard in self.shards:
            shard.fault_peers = [s.aggregator for s in self.shards if s is not shard]
            if each is None:
                shard.shard_ports = ports  # replies name them: one address finds all

    @property
    def address_text(self) -> str:
        """What INA_SWITCH says to stripe across every shard."""
        return ",".join("%s:%d" % shard.address[:2] for shard in self.shards)

    @property
    def aggregator(self):
        return self.shards[0].aggregator

    def stop(self, *_: object) -> None:
        for shard in self.shards:
            shard.stop()

    def serve(self, stats_interval: float = 0.0) -> None:
        """Every shard's loop until stop(): the first in this thread (where signals
        arrive), the others in threads of their own; the status line, of all of them."""
        threads = [threading.Thread(target=shard.serve, name=f"ina-shard-{i}", daemon=True)
                   for i, shard in enumerate(self.shards[1:], 1)]
        for thread in threads:
            thread.start()
        try:
            self.shards[0].serve(stats_interval, status=self.status_line)
        finally:
            self.stop()
            for thread in threads:  # each loop looks at its stop flag every 100 ms
                thread.join(self.STOP_BOUND)
                if thread.is_alive():
                    log.error("%s did not stop within %g s", thread.name, self.STOP_BOUND)

    def stats(self) -> dict:
        total: dict = {}
        for shard in self.shards:
            for name, value in shard.stats().items():
                if name == "jobs":  # a job on several shards: slots and results added
                    merged = total.setdefault(name, {})
                    for job, counts in value.items():
                        into = merged.setdefault(job, dict(counts, slots=0, asked=0,
                                                           results=0))
                        for key in ("slots", "asked", "results"):
                            into[key] += counts[key]
                elif isinstance(value, dict):
                    merged = total.setdefault(name, {})
                    for key, count in value.items():
                        merged[key] = (merged.get(key, 0) + count if name != "faults"
                                       else count)
                elif isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and name != "last_send_errno":
                    total[name] = total.get(name, 0) + value
                else:
                    total.setdefault(name, value)
        return total

    def status_line(self) -> str:
        lines = [shard.status_line() for shard in self.shards] if len(self.shards) > 1 else []
        return "\n".join(lines + [status_text(self.address_text, self.stats())])
