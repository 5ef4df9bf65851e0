"""Loading at a layout other than the saved one: ZeRO-1 re-sharding across DP (``zero1`` math, ``zero1_io``
reading the shards a rank needs)."""
