"""Measurements more than one suite reports, each made in one place."""
