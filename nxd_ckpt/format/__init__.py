"""The on-disk format's owners, asked by the loader, inspect, verify and the tools: ``layout`` (every file name),
``metadata`` (``nxd_ckpt.json`` as one type), ``manifests`` and ``hashing`` (per-rank checksum files),
``integrity`` (verified reads), ``describe`` (a saved tag's layout and the files it must hold) and ``tags``
(markers, ``latest``, retention, re-saves)."""
