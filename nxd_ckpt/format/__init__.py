"""The on-disk format's owners, asked by the loader, inspect, verify and the tools: ``layout`` (every file name),
``metadata`` (``nxd_ckpt.json`` as one type), ``manifests`` and ``hashing`` (per-rank checksum files),
``integrity`` (verified reads), ``describe`` (a saved tag's layout and the files it must hold), ``tags``
(markers, the order of tags, ``latest``), ``resave`` (a re-save beside a complete tag, swapped in, recovered after
a crash) and ``retention`` (which tags a policy deletes, and how)."""
