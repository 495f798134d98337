"""Multi-rank jobs of the library on this machine (loopback): one command each
(call_breakdown, striping, standby, soak, ddp_loopback); a ``*_ranks`` module is what a
job's ranks run."""
