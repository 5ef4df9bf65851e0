"""``nxd-ckpt``: look into, check, prune and export checkpoints from the shell.

Exit status: 0 on success, 1 when the operation failed (or ``verify`` found a problem), 2 for usage errors.
Results go to stdout, diagnostics to stderr; progress bars appear only when stderr is a terminal.
The package: ``entry`` (``main``) -> ``parser`` (the subcommand table) -> the commands (``tag_commands``,
``inspect_command``, ``layout_commands``; for TorchTitan's ``step-N`` folders and one DCP or Hugging Face folder
named itself, ``dcp_commands`` and ``hf_commands``) -> ``locate``, ``progress``, ``output``.
"""

from nxd_ckpt.cli.entry import main

__all__ = ["main"]
