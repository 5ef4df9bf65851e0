"""Everything between ranks (named ``ranks``: ``dist`` reads as a build-output folder): ``coordinator`` (the only
module that calls torch.distributed: collectives that carry failures, deadlines on the store), ``topology`` (the
rank table of TP/PP/DP/EP/CP groups) and ``replicas`` (DP replicas sharing the reads of one state file)."""
