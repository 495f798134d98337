"""The worker's side of in-network aggregation: below the INA engine, above the wire.

``link``: WorkerLink, the worker's UDP socket to the aggregator (join, probe, leave, and
the windowed stream of _fast/transport.pyx); ``kernels``: the quantization and packet
kernels, compiled (_fast/) or the NumPy ``reference`` that is their oracle.
"""
