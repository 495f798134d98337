"""What the tests and the benchmarks share to run the library as a job, as numpy.testing
or torch.testing serve their projects' tests; not the library's API.

* ``jobs``: the launcher (a command run in a process group of its own, killed whole past
  its bound: ``run_group``), mpiexec's command line (``mpiexec_line``, each rank in a
  network namespace if asked) and the children's environment (``child_env``);
* ``fabric``: the namespace fabric (``Fabric``): workers and aggregators in network
  namespaces on a bridge or on bare switch ports, links shaped, packets dropped;
* ``bmv2``: the P4 program on BMv2 (the toolchain found, a build compiled, the switch run).

``fabric`` and ``bmv2`` need root and pyroute2 (the bench extra) where they build
namespaces; ``jobs`` needs neither.
"""
