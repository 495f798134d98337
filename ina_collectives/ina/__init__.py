"""The INA engine's layer: one allreduce through the aggregators, and the worker's side of
in-network aggregation below it.

``engine``: InaEngine (collectives.engine's OffloadEngine), the steps of a call in order, from
its parts: ``aggregators`` (the links: joining, losing and regaining them), ``preparing``
(a call made ready), ``opening`` (its identity and first exponents agreed in-band),
``striping`` (a call's shares across several aggregators, streamed at once), ``outcome``
(the ranks' vote), ``rescue`` (a call that ended without it, which a rank could not
finish alone), ``repair`` (quorum chunks a rank lost) and ``quorum`` (the mode);
``link``: WorkerLink, the worker's UDP socket to the aggregator (join, probe, leave, and
the windowed stream of _fast/transport.pyx; ``Timers``); ``kernels``: the quantization
and packet kernels, compiled (_fast/) or the NumPy ``reference`` that is their oracle.
``offload``: what the layer above (runtime, mpi, the array API) gives the chooser of the
engine (``offload_for(settings)``: the engine or None, INA_SWITCH and INA_REQUIRE_SWITCH
read here; ``ABSENT``: what stats() shows without it); ``summary``: stats() in one
paragraph, the switch's sentences in it. Nothing here is imported by collectives/, which
never names a switch.
"""
