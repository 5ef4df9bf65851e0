"""The memory tier: checkpoints kept in node memory, copied to peer nodes, written to durable storage every K
saves; restores pick the newest complete copy across tiers (docs/memory-tier.md)."""
