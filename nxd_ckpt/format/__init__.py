"""The on-disk format's owners: ``metadata`` (``nxd_ckpt.json`` as one type), ``manifests`` (per-rank checksum
files) and ``describe`` (a saved tag's layout and the files it must hold), asked by the loader, inspect, verify
and the tools. File names themselves stay in ``nxd_ckpt.layout``."""
