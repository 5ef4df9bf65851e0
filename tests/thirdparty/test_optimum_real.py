"""optimum-neuron's real save (``NeuronModelMixin.save_pretrained`` of the pinned sources, with its
``_wait_previous_async_save`` reaching ``g_iostate``) and consolidation running on nxd_ckpt through
``nxd_ckpt.compat.install()``: its layout (``shards``, ``mp_metadata_pp_rank_*.json``, ``trn_config.json``, the
trainer's scheduler file) round-trips, ``load_checkpoint`` resumes model and optimizer from its output directory
(the resume its trainer refuses), and its consolidation reads the tags nxd_ckpt wrote."""

from __future__ import annotations

import json
import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import cli
from nxd_ckpt.format import layout
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla
pytest.importorskip("torch_xla", reason="needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla)")

SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer_utils' name, which NeuronTrainer._save_checkpoint uses


def _tiny_llama(seed: int, async_save: bool = False, use_xser: bool = True):
    from optimum.neuron.models.training import LlamaForCausalLM, TrainingNeuronConfig
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    trn_config = TrainingNeuronConfig(tensor_parallel_size=1, use_xser=use_xser, async_save=async_save)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, trn_config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _step(model, opt, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    sched.step()


def _save_like_neuron_trainer(optimum_real, model, opt, sched, output_dir: str) -> None:
    """What ``NeuronTrainer._save_checkpoint`` does with model parallelism: ``save_pretrained(out,
    optimizer=...)``, then the scheduler through ``xm.save``."""
    import torch_xla.core.xla_model as xm

    optimum_real["modeling_utils"].NeuronModelMixin.save_pretrained(model, output_dir, optimizer=opt)
    xm.save(sched.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


@pytest.mark.parametrize(("use_xser", "async_save"), [(True, False), (True, True), (False, False)])
def test_save_pretrained_round_trips_and_resumes(optimum_real, nxd_compat, tmp_path, use_xser, async_save):
    model, opt, sched = _tiny_llama(0, async_save=async_save, use_xser=use_xser)
    _step(model, opt, sched, seed=1)
    dirs = []
    for step in (1, 2):  # as the trainer saves: a new directory each time, the previous async save waited for
        _step(model, opt, sched, seed=1 + step)
        dirs.append(str(tmp_path / f"checkpoint-{step}"))
        _save_like_neuron_trainer(optimum_real, model, opt, sched, dirs[-1])
    nxd.finalize_checkpoint()
    out = dirs[-1]
    for d in dirs:
        # + the (hidden) tag index of latest, which optimum's loader never reads
        assert sorted(os.listdir(d)) == [".nxd-tags.json", "config.json", "scheduler.pt", "shards", "trn_config.json"]
        shards = sorted(os.listdir(os.path.join(d, "shards")))
        assert {"done", "model", "optim", "mp_metadata_pp_rank_0.json"} <= set(shards)
        assert nxd.list_checkpoint_tags(d) == ["shards"] and nxd.verify(d, "shards").ok
    with open(os.path.join(out, "trn_config.json")) as f:
        assert json.load(f)["async_save"] is async_save

    # The recipe (docs/optimum-neuron.md): resume model, optimizer and scheduler from the output directory.
    model2, opt2, sched2 = _tiny_llama(5)
    nxd.load_checkpoint(out, tag="shards", model=model2, optimizer=opt2)
    sched2.load_state_dict(torch.load(os.path.join(out, SCHEDULER_NAME), weights_only=True))
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(opt2.state_dict(), opt.state_dict())
    _step(model, opt, sched, seed=9)
    _step(model2, opt2, sched2, seed=9)
    assert_state_equal(model2.state_dict(), model.state_dict())


@pytest.mark.parametrize("inline_bytes", ["0", "65536"], ids=["tensor-files", "inline"])
def test_consolidation_reads_nxd_ckpt_tags(optimum_real, nxd_compat, tmp_path, monkeypatch, inline_bytes):
    """optimum-neuron's consolidation (``optimum-cli neuron consolidate``) on the tag nxd_ckpt wrote: xser with a
    file per tensor, and with small tensors inside the reference files (no ``.tensors`` folders at all)."""
    from safetensors.torch import load_file

    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", inline_bytes)
    model, opt, sched = _tiny_llama(0)
    _step(model, opt, sched, seed=1)
    out = str(tmp_path / "out")
    _save_like_neuron_trainer(optimum_real, model, opt, sched, out)
    optimum_real["checkpointing"].consolidate_model_parallel_checkpoints_to_unified_checkpoint(out, f"{out}/hf")
    consolidated = load_file(f"{out}/hf/model.safetensors")
    expected = {}
    inter = model.config.intermediate_size
    for name, tensor in model.state_dict().items():
        if "gate_up_proj" in name:  # optimum fuses gate and up projections; consolidation splits them back
            expected[name.replace("gate_up_proj", "gate_proj")] = tensor[:inter]
            expected[name.replace("gate_up_proj", "up_proj")] = tensor[inter:]
        else:
            expected[name] = tensor
    assert sorted(consolidated) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(consolidated[name], tensor.detach().cpu()), name

    # nxd-ckpt export of the same output directory writes the same tensors under the same names.
    assert cli.main(["export", out, "--out", f"{out}/exported", "--no-progress"]) == 0
    exported = {}
    for name in os.listdir(f"{out}/exported"):
        if name.endswith(".safetensors"):
            exported.update(load_file(f"{out}/exported/{name}"))
    assert sorted(exported) == sorted(consolidated)
    for name, tensor in consolidated.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_peft_adapter_shards_round_trip(optimum_real, nxd_compat, tmp_path, async_save):
    """optimum-neuron's PEFT save (``NeuronPeftModel.save_pretrained``: metadata first, then ``tag="adapter_shards"``)
    twice into the same directory (the second a re-save of a complete tag); the adapter loads back and
    optimum-neuron's consolidation reads it."""
    from optimum.neuron.peft import get_peft_model
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    model, _, _ = _tiny_llama(0, async_save=async_save)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    out = str(tmp_path / "adapter_out")
    for bump in (0.5, 0.25):
        with torch.no_grad():
            for p in peft_model.parameters():
                if p.requires_grad:
                    p.add_(bump)
        optimum_real["peft_model"].NeuronPeftModel.save_pretrained(peft_model, out)
    nxd.finalize_checkpoint()
    adapter_dir = os.path.join(out, "adapter_default")
    shards = sorted(os.listdir(os.path.join(adapter_dir, layout.OPTIMUM_ADAPTER_SHARDS_TAG)))
    assert {"done", "model", "mp_metadata_pp_rank_0.json"} <= set(shards)
    assert nxd.verify(adapter_dir, layout.OPTIMUM_ADAPTER_SHARDS_TAG).ok

    loaded: dict = {}
    nxd.load_checkpoint(adapter_dir, tag=layout.OPTIMUM_ADAPTER_SHARDS_TAG, model=loaded)
    saved = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(peft_model).items()}  # what it saves
    assert sorted(loaded) == sorted(saved) and saved
    assert_state_equal({k: loaded[k] for k in sorted(loaded)}, {k: saved[k] for k in sorted(saved)})

    optimum_real["checkpointing"].consolidate_model_parallel_checkpoints_to_unified_checkpoint(out, f"{out}/hf")
    consolidated = load_file(f"{out}/hf/adapter_model.safetensors")
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.equal(consolidated[q_a], saved[q_a])


def test_zero1_resume_from_an_output_directory(optimum_real, nxd_compat, tmp_path):
    """The resume optimum-neuron's users ask for (its issues #694, #273): ZeRO-1 optimizer state saved by
    ``save_pretrained`` loads back with ``load_checkpoint`` and training continues identically (DP=1 here; other
    DP sizes re-shard on load, tests/distributed/test_zero1_reshard.py)."""
    import torch_xla
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    def make(seed: int):
        model, _, _ = _tiny_llama(seed)
        model = model.to(torch_xla.device())
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

    def step(model, opt, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=g).to(p.device)).sum() for p in model.parameters())
        loss.backward()
        opt.step()
        torch_xla.sync()

    model, opt = make(0)
    step(model, opt, 1)
    out = str(tmp_path / "checkpoint-1")
    optimum_real["modeling_utils"].NeuronModelMixin.save_pretrained(model, out, optimizer=opt)
    meta = json.loads((tmp_path / "checkpoint-1" / "shards" / layout.METADATA_FILE).read_text())
    assert meta["zero1"] is True
    model2, opt2 = make(5)
    nxd.load_checkpoint(out, tag=layout.OPTIMUM_SHARDS_TAG, model=model2, optimizer=opt2)
    step(model, opt, 2)
    step(model2, opt2, 2)
    assert_state_equal(model2.state_dict(), model.state_dict())


def test_zero1_inside_optimum_neurons_accelerated_optimizer_is_saved_as_zero1(optimum_real, nxd_compat, tmp_path):
    """optimum-neuron's trainer (ZeRO-1 is ``NeuronTrainingArguments``' default) hands ``save_pretrained`` its
    optimizer as accelerate prepared it: the real ``NeuronAcceleratedOptimizer`` around NxD's real
    ``NeuronZero1Optimizer``. The tag records ZeRO-1 (at DP > 1 a plain record would keep DP rank 0's shard only:
    tests/distributed/test_zero1_wrappers.py), and the resume continues exactly."""
    import torch_xla
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from neuronx_distributed.optimizer import NeuronZero1Optimizer
    from optimum.neuron.accelerate.optimizer import NeuronAcceleratedOptimizer

    Accelerator()  # as the trainer's NeuronAccelerator does first
    try:

        def make(seed: int):
            model, _, _ = _tiny_llama(seed)
            model = model.to(torch_xla.device())
            zero1 = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, pin_layout=False)
            return model, NeuronAcceleratedOptimizer(zero1, device_placement=False)

        def step(model, opt, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            opt.zero_grad()
            loss = sum((p * torch.randn(p.shape, generator=g).to(p.device)).sum() for p in model.parameters())
            loss.backward()
            opt.optimizer.step()
            torch_xla.sync()

        model, opt = make(0)
        step(model, opt, 1)
        out = str(tmp_path / "checkpoint-1")
        optimum_real["modeling_utils"].NeuronModelMixin.save_pretrained(model, out, optimizer=opt)
        meta = json.loads((tmp_path / "checkpoint-1" / "shards" / layout.METADATA_FILE).read_text())
        assert meta["zero1"] is True and meta["zero1_dp_size"] == 1
        model2, opt2 = make(5)
        nxd.load_checkpoint(out, tag=layout.OPTIMUM_SHARDS_TAG, model=model2, optimizer=opt2)
        assert_state_equal(opt2.optimizer.state_dict()["base_state"], opt.optimizer.state_dict()["base_state"])
        step(model, opt, 2)
        step(model2, opt2, 2)
        assert_state_equal(model2.state_dict(), model.state_dict())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
