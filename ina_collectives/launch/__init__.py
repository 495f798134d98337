"""The launcher, ``ina-run`` (``python -m ina_collectives.launch``): ``cli`` (the command:
the aggregator started or reached, the job configured, the ranks run, everything cleaned
up), ``ranks`` (the ranks under mpiexec or torchrun, supervised and stopped within a
bound), ``horovodrun`` (horovodrun's options, turned into ina-run's and the ranks'
environment), ``rank`` (what each rank starts as: run by path, standard library only).
"""
