"""The software aggregator's data path: SwitchML's slot rule on batched UDP, no GIL."""

DROP_REASONS: tuple[str, ...]
FEATURES: int
"""Every protocol.CAP_* the software aggregator can serve."""

class FaultInjection:
    """Drop, duplicate, reorder and delay packets in either direction, while running."""
    FAULTS: tuple[str, ...]
    def set_faults(self, **faults: float) -> None:
        """``<fault>_<in|out>`` for drop, duplicate, reorder, delay_ms; others cleared."""
    def faults(self) -> dict[str, float]:
        """The faults in force, as set_faults takes them (zero ones left out)."""

class Aggregator(FaultInjection):
    """One UDP socket's aggregation state: jobs by id, counters."""
    REGISTERS: tuple[str, ...]
    packets_in: int
    packets_out: int
    results: int
    retransmits_answered: int
    nacks: int
    result_requests: int
    held_replies: int
    """Resent packets answered "held" (a NACK naming none): the cell waits for a peer."""
    late_answered: int
    openings: int
    gso: int
    """1: results leave with UDP_SEGMENT; 0: sendmmsg."""
    send_calls: int
    gro_buffers: int
    features: int
    """protocol.CAP_* served and announced (FEATURES: all; fewer with --like tofino)."""
    control_overflow: int
    send_failures: int
    last_errno: int
    sent_up: int
    resent_up: int
    came_down: int
    stale_down: int
    parent_held: int
    parent_nacks: int
    leaves: bool
    def __init__(self, fd: int, seed: int = ...) -> None:
        """Aggregate the datagrams of UDP socket ``fd``; seed: the fault injection's RNG."""
    def add_job(self, job_id: int, n: int, k: int, slots: int, block: int = 32,
                value_bits: int = 32) -> bool:
        """Create a job (n workers, K values of value_bits in sub-blocks of block, S
        slots); False if no memory."""
    def set_mode(self, job_id: int, quorum: int, generation: int) -> None:
        """A managed job's mode (quorum k, 0: sync) as its results announce it."""
    def mode(self, job_id: int) -> tuple[int, int] | None:
        """(quorum, generation) of a job, or None."""
    def job_ids(self) -> list[int]:
        """The ids of the jobs present, in order."""
    def job_results(self, job_id: int) -> int | None:
        """Results a job's slots have multicast, or None if there is no such job."""
    def set_managed(self, job_id: int) -> None:
        """The job is a controller's: results go to its replicas; KeyError if no job."""
    def set_parent(self, job_id: int, addr_be: int, port_be: int, worker: int) -> None:
        """The job is a tree's leaf here: completed cells go up to the parent at this
        address as its worker ``worker``; KeyError if no job."""
    def clear_parent(self, job_id: int) -> None:
        """The job is no tree's leaf here any more; KeyError if no job."""
    def is_managed(self, job_id: int) -> bool:
        """Whether the job is a controller's (False if there is no such job)."""
    def set_replicas(self, job_id: int, replicas: list[tuple[int, int]]) -> None:
        """Where a managed job's results go: [(addr_be, port_be)]; KeyError if no job."""
    def clear_worker(self, job_id: int, worker: int) -> None:
        """Forget a worker's address; KeyError if no job, IndexError if no such worker."""
    def worker_at(self, job_id: int, worker: int, addr_be: int, port_be: int) -> bool:
        """Whether the worker of the job is admitted at this address."""
    def get_cell(self, job_id: int, cell: int, what: str | int | tuple[str, int]) -> int:
        """A cell's bitmap, count, chunk, epoch, ("exponent", g), ("proposal", g), or
        value ``what`` (an index)."""
    def set_cell(self, job_id: int, cell: int, what: str | int | tuple[str, int],
                 value: int) -> None:
        """Write a cell's register ``what`` (as get_cell names them) or value ``what``."""
    def drop_count(self, reason: int) -> int:
        """Packets dropped for reason ``reason`` (an index of DROP_REASONS)."""
    def job_shape(self, job_id: int) -> tuple[int, int, int, int, int] | None:
        """(n, K, S, B, value bits) of a job, or None."""
    def set_worker(self, job_id: int, worker: int, addr_be: int, port_be: int) -> bool:
        """Admit a worker at this address; False if bound elsewhere, or no such job/worker."""
    def leave(self, job_id: int, worker: int) -> bool:
        """A worker left; True if that freed the job."""
    def free_job(self, job_id: int) -> None:
        """Forget a job and its state; KeyError if there is none."""
    def idle_jobs(self, idle_seconds: float) -> list[int]:
        """Ids of the jobs that sent nothing for idle_seconds."""
    def busy_slots(self) -> int:
        """Slot versions with a partial aggregation, over all jobs."""
    def drop_counts(self) -> dict[str, int]:
        """The nonzero drop counters, by reason."""
    def reply(self, packet: bytes, addr_be: int, port_be: int) -> None:
        """Send one control reply; SystemCallError if the kernel refuses."""
    def run(self, timeout_ms: int) -> list[tuple[bytes, int, int]]:
        """Aggregate until control packets come or timeout_ms pass idle; those packets."""
