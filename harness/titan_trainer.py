"""TorchTitan's real trainer with this library's checkpoint manager, as a user runs it: ``torchrun -m
torchtitan.train --module harness.titan_trainer --config nxd_ckpt_llama3_debugmodel [--section.key value ...]``.

``nxd_ckpt_llama3_debugmodel`` is a config-registry function (TorchTitan's ``ConfigManager`` imports this module
and calls it): TorchTitan's own ``llama3_debugmodel`` job with its ``checkpoint`` config replaced by
``nxd_ckpt.torchtitan.CheckpointManager.Config``, which selects this library's manager, and a tokenizer and data
set made here (``write_assets``: the job must run without a network, and the wheel ships neither). Its trainer
is ``ObservedTrainer``, TorchTitan's ``Trainer`` with two observation points the tests set from the command line:
``--losses_file`` (each logged step's loss, in full precision) and ``--kill_after_save_step`` (SIGKILL right after
that step's ``checkpointer.save`` returned: an async save is still in flight).

Importing this module needs only torchtitan's config classes; the config function imports the trainer (which
needs triton, i.e. a CUDA build of torch)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
from typing import Any

from nxd_ckpt.torchtitan import CheckpointManager

VOCAB_WORDS = 1000
"""Words of the made-up language (ids 3..1002, within the debug model's 2,048-entry vocabulary)."""
SPECIAL_TOKENS = ("[UNK]", "<|begin_of_text|>", "<|end_of_text|>")
DEFAULT_STEPS = 8
DEFAULT_INTERVAL = 2


def write_assets(root: str, documents: int = 400, seed: int = 0) -> tuple[str, str]:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, as ``hf_assets_path`` holds them)
    and a C4-like data set (``train.jsonl`` of ``{"text": ...}``) under ``root``; returns (tokenizer folder, data
    set folder). Deterministic: the same files for the same arguments."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "c4_mini")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": len(SPECIAL_TOKENS) + i for i in range(VOCAB_WORDS)})
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "unk_token": SPECIAL_TOKENS[0]}, f)
    rng = random.Random(seed)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for _ in range(documents):
            # a skewed word distribution, so that the model has something to learn in a few steps
            words = [f"w{min(int(rng.expovariate(0.02)), VOCAB_WORDS - 1)}" for _ in range(rng.randint(50, 400))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return tokenizer_dir, data_dir


def checkpoint_config(**overrides: Any) -> CheckpointManager.Config:
    """The job's ``checkpoint`` section: this library's manager, enabled, saving every ``DEFAULT_INTERVAL``
    steps into ``<dump_folder>/checkpoint``."""
    options: dict[str, Any] = {"enable": True, "folder": "checkpoint", "interval": DEFAULT_INTERVAL}
    return CheckpointManager.Config(**{**options, **overrides})


def _observed_trainer_class() -> type:
    """``ObservedTrainer`` (defined on first use: it subclasses TorchTitan's ``Trainer``, whose import needs
    triton)."""
    global ObservedTrainer
    if "ObservedTrainer" in globals():
        return ObservedTrainer
    from torchtitan.trainer import Trainer

    class _ObservedTrainer(Trainer):
        """TorchTitan's ``Trainer``, observed: each logged loss appended to ``losses_file`` (rank 0), and the
        process SIGKILLed right after ``checkpointer.save`` of ``kill_after_save_step`` returned."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            losses_file: str = ""
            """Append ``{"step", "loss"}`` lines here (rank 0), each as it is logged."""
            kill_after_save_step: int = 0
            """SIGKILL every rank right after the save of this step (0: never)."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            log, save = self.metrics_processor.log, self.checkpointer.save

            def logged(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
                log(step, global_avg_loss, *args, **kwargs)
                if config.losses_file and int(os.environ.get("RANK", "0")) == 0:
                    with open(config.losses_file, "a") as f:
                        f.write(json.dumps({"step": step, "loss": float(global_avg_loss)}) + "\n")

            def saved(curr_step: int, last_step: bool = False) -> bool:
                result = save(curr_step, last_step=last_step)
                if curr_step == config.kill_after_save_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return result

            self.metrics_processor.log = logged
            self.checkpointer.save = saved

    ObservedTrainer = _ObservedTrainer
    return ObservedTrainer


def nxd_ckpt_llama3_debugmodel() -> Any:
    """TorchTitan's ``llama3_debugmodel`` job with this library's manager (``checkpoint_config``), short: 8 steps
    of 2 x 128 tokens, deterministic, the assets of ``write_assets`` (``--hf_assets_path`` and
    ``--dataloader.dataset_path`` point at them), no CUDA graphs (TorchTitan's default wraps the step in one)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    base = llama3_debugmodel()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    config = _observed_trainer_class().Config(**fields)
    config.checkpoint = checkpoint_config(last_save_model_only=base.checkpoint.last_save_model_only)
    config.training.steps = DEFAULT_STEPS
    config.training.seq_len = 128
    config.training.local_batch_size = 2
    config.training.disable_cuda_graphs = True
    config.lr_scheduler.warmup_steps = 2
    config.debug.seed = 0
    config.debug.deterministic = True
    config.debug.deterministic_warn_only = True
    config.metrics.log_freq = 1
    return config
