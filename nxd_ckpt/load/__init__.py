"""A load's steps: ``pipeline`` (composed in order), ``candidates`` (which tag, agreed on by every rank),
``read_plan`` (which files this rank reads into what: a value), ``read`` (executing it), ``report``; loading at a
layout other than the saved one: ``reshard`` (any TP/PP), ZeRO-1 re-sharding across DP (``zero1`` math,
``zero1_io`` reading the shards a rank needs)."""
