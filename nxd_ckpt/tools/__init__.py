"""What works on saved checkpoints from outside a training job (single process, no process group):
``verification`` (``nxd_ckpt.verify``) with ``completeness`` (the files a tag must hold, checked without
reading data), ``export`` (safetensors), and the ZeRO-1 converter (``convert_zero1``, ``zero1_cli``)."""
