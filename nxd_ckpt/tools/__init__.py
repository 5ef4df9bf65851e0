"""Offline tools that work on saved checkpoints (single process, no process group)."""
