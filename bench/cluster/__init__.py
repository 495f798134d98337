"""The emulated cluster's scenarios (root): each rank in a network namespace of the
fabric (ina_collectives/testing/fabric.py), its link shaped, packets dropped. netsim:
every system's allreduce; training: wall time to a target loss, with priority and
overlap, quorum and stragglers."""
