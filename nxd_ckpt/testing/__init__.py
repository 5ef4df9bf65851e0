"""Test helpers shipped with the package: run plain functions on N spawned gloo ranks, tiny models."""
