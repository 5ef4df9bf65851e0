"""The test harness (not shipped in the wheel): spawned gloo ranks, crash loops, a power-loss filesystem, an S3
server, a fake native accelerator, fake NxD, the pinned third-party code, and the models and scenarios these share.

It imports nxd_ckpt, never the other way round. Tests import it from the repository root (pytest's
``pythonpath = ["."]``); a process the harness starts gets the root on its path from the harness.
"""
