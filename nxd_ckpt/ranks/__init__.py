"""Everything between ranks (named ``ranks``: ``dist`` reads as a build-output folder): ``coordinator`` (the only
module that calls torch.distributed: the world, collectives that carry failures), ``arrivals`` (checking in and
waiting on the c10d store under a deadline), ``failures`` (one rank's exception raised on every rank),
``deadlines`` (the deadline setting), ``topology`` (the rank table of TP/PP/DP/EP/CP groups) and ``replicas``
(DP replicas sharing the reads of one state file)."""
