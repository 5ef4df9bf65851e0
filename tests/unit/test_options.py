"""SaveOptions/LoadOptions: NxD's parameters and ours, defined once, validated once, and carried as one value from
``save_checkpoint``/``load_checkpoint`` through the manager to the pipelines."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import api
from nxd_ckpt.errors import InvalidTagError
from nxd_ckpt.format.retention import KeepLatest
from nxd_ckpt.load.pipeline import LoadPipeline
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.options import LoadOptions, SaveOptions
from nxd_ckpt.save.context import SaveOutcome
from nxd_ckpt.save.pipeline import SavePipeline
from nxd_ckpt.testing.fakes import TinyMLP, make_training, train_steps

# NxD names the directory parameter differently in its two functions; the options call it checkpoint_dir.
_RENAMED = {"checkpoint_dir_str": "checkpoint_dir", "path": "checkpoint_dir"}


def _as_parameters(cls: type) -> list[tuple[str, str, object, str]]:
    """(name, kind, default, annotation) of each of ``cls``'s init fields, as a function parameter would show it."""
    return [
        (
            f.name,
            "keyword-only" if f.kw_only else "positional or keyword",
            inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            str(f.type),
        )
        for f in dataclasses.fields(cls)
        if f.init
    ]


def _signature_parameters(fn) -> list[tuple[str, str, object, str]]:
    return [
        (_RENAMED.get(name, name), p.kind.description, p.default, str(p.annotation))
        for name, p in inspect.signature(fn).parameters.items()
    ]


@pytest.mark.parametrize(("fn", "cls"), [(api.save_checkpoint, SaveOptions), (api.load_checkpoint, LoadOptions)])
def test_every_parameter_is_an_option_in_the_same_order(fn, cls):
    """The functions' written-out signatures are the options' fields: the same names in the same order (NxD's
    positional order holds in the options too, so ``SaveOptions(*args)`` means what NxD means), the same split
    into positional and keyword-only, the same defaults and the same type annotations; a field added to one and
    not the other fails here."""
    assert _signature_parameters(fn) == _as_parameters(cls)


def _non_default_save_arguments(tmp_path) -> dict:
    """A value for every save parameter that differs from its default (and passes validation)."""
    model, opt, sched = make_training(seed=1)
    return {
        "checkpoint_dir_str": str(tmp_path / "ckpt"),
        "tag": "step_7",
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "user_content": {"step": 7},
        "num_workers": 3,
        "use_xser": True,
        "num_kept_ckpts": 2,
        "async_save": True,
        "zero1_optimizer": True,
        "use_zero1_dcp": True,
        "avoid_saving_lower_precision_weights": False,  # cannot be combined with use_zero1_dcp (as in NxD)
        "rank_state": {"loader": object()},
        "save_rng": True,
        "rank_state_mode": "gather",
        "timeout": 12.5,
        "on_save_error": "warn",
        "memory_tier": nxd.MemoryTier(dir=str(tmp_path / "mem")),
        "host_memory_budget": "96MiB",
        "device_snapshot_budget": "1GiB",
    }


def _non_default_load_arguments(tmp_path) -> dict:
    model, opt, sched = make_training(seed=1)
    return {
        "path": str(tmp_path / "ckpt"),
        "tag": "step_7",
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "num_workers": 3,
        "strict": False,
        "use_zero1_dcp": True,
        "allow_pickle": True,
        "rank_state": {"loader": object()},
        "skip_rank_state": True,
        "device": "cpu",
        "verify": False,
        "fallback_to_verified": True,
        "timeout": 12.5,
        "sharding": {"*.weight": 0},
        "memory_tier": nxd.MemoryTier(dir=str(tmp_path / "mem")),
    }


def test_every_save_argument_reaches_the_save_pipeline(tmp_path, monkeypatch):
    seen: list[SaveOptions] = []
    monkeypatch.setattr(SavePipeline, "run", lambda self, options, report: seen.append(options) or SaveOutcome())
    arguments = _non_default_save_arguments(tmp_path)
    defaults = {n: p.default for n, p in inspect.signature(api.save_checkpoint).parameters.items()}
    assert all(
        arguments[name] is not defaults[name] for name in defaults if name != "avoid_saving_lower_precision_weights"
    )
    api.save_checkpoint(**arguments)
    (options,) = seen
    for name, value in arguments.items():
        assert getattr(options, _RENAMED.get(name, name)) is value, name
    assert options.timeout_s == 12.5 and options.budget_bytes == 96 << 20


def test_avoid_saving_lower_precision_weights_reaches_the_save_pipeline(tmp_path, monkeypatch):
    seen: list[SaveOptions] = []
    monkeypatch.setattr(SavePipeline, "run", lambda self, options, report: seen.append(options) or SaveOutcome())
    api.save_checkpoint(str(tmp_path), "t", model=TinyMLP(), avoid_saving_lower_precision_weights=True)
    assert seen[0].avoid_saving_lower_precision_weights is True


def test_every_load_argument_reaches_the_load_pipeline(tmp_path, monkeypatch):
    seen: list[LoadOptions] = []
    monkeypatch.setattr(LoadPipeline, "run", lambda self, options: seen.append(options) or {"returned": 1})
    arguments = _non_default_load_arguments(tmp_path)
    defaults = {n: p.default for n, p in inspect.signature(api.load_checkpoint).parameters.items()}
    assert all(arguments[name] is not defaults[name] for name in defaults)
    assert api.load_checkpoint(**arguments) == {"returned": 1}
    (options,) = seen
    for name, value in arguments.items():
        assert getattr(options, _RENAMED.get(name, name)) is value, name


def test_positional_arguments_keep_nxds_order(tmp_path, monkeypatch):
    seen: list = []
    monkeypatch.setattr(SavePipeline, "run", lambda self, options, report: seen.append(options) or SaveOutcome())
    monkeypatch.setattr(LoadPipeline, "run", lambda self, options: seen.append(options))
    model = TinyMLP()
    # NxD: (checkpoint_dir_str, tag, model, optimizer, scheduler, user_content, num_workers, use_xser, num_kept_ckpts,
    # async_save, zero1_optimizer, use_zero1_dcp, avoid_saving_lower_precision_weights)
    api.save_checkpoint(str(tmp_path), "t", model, None, None, {"u": 1}, 2, True, 3, False, True)
    # NxD: (path, tag, model, optimizer, scheduler, num_workers, strict, use_zero1_dcp)
    api.load_checkpoint(str(tmp_path), "t", model, None, None, 4, False)
    save, load = seen
    assert (save.user_content, save.num_workers, save.use_xser, save.num_kept_ckpts, save.zero1_optimizer) == (
        {"u": 1}, 2, True, 3, True,
    )  # fmt: skip
    assert (load.num_workers, load.strict) == (4, False)


def test_options_are_frozen(tmp_path):
    options = SaveOptions(str(tmp_path), "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.tag = "other"  # type: ignore[misc]
    assert options.replace(tag="other").tag == "other" and options.tag == "t"


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"tag": "../up"}, InvalidTagError, "tag"),
        ({"num_kept_ckpts": 0}, ValueError, "num_kept_ckpts must be None or -1"),
        ({"num_kept_ckpts": True}, ValueError, "num_kept_ckpts"),
        ({"num_workers": 0}, ValueError, "num_workers must be an integer >= 1"),
        ({"on_save_error": "ignore"}, ValueError, "on_save_error must be 'raise' or 'warn'"),
        ({"rank_state_mode": "shared"}, ValueError, "rank_state_mode must be one of 'per_rank', 'gather'"),
        ({"timeout": -1}, ValueError, "timeout must be a positive number"),
        ({"memory_tier": "/dev/shm"}, TypeError, "memory_tier must be a nxd_ckpt.MemoryTier"),
        ({"host_memory_budget": "lots"}, ValueError, "host_memory_budget='lots' is not a size"),
        ({"host_memory_budget": 0}, ValueError, "host_memory_budget must be"),
        ({"device_snapshot_budget": "most"}, ValueError, "device_snapshot_budget='most' is not a size"),
        ({"device_snapshot_budget": -1}, ValueError, "device_snapshot_budget must be"),
        ({"use_zero1_dcp": True, "avoid_saving_lower_precision_weights": True}, ValueError, "cannot be combined"),
    ],
)
def test_bad_save_options_fail_before_anything_is_written(tmp_path, arguments, error, match):
    ckpt = tmp_path / "ckpt"
    model = TinyMLP()
    arguments = {"tag": "step_1", **arguments}
    with pytest.raises(error, match=match):
        nxd.save_checkpoint(str(ckpt), model=model, **arguments)
    assert not ckpt.exists()


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"num_workers": 0}, ValueError, "num_workers must be an integer >= 1"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"memory_tier": 3}, TypeError, "memory_tier must be a nxd_ckpt.MemoryTier"),
    ],
)
def test_bad_load_options_fail_before_anything_is_read(tmp_path, arguments, error, match):
    with pytest.raises(error, match=match):
        nxd.load_checkpoint(str(tmp_path / "absent"), model=TinyMLP(), **arguments)


def test_num_kept_ckpts_minus_one_keeps_all(tmp_path):
    assert SaveOptions(str(tmp_path), "t", num_kept_ckpts=-1).retention is None
    assert SaveOptions(str(tmp_path), "t", num_kept_ckpts=None).retention is None
    assert SaveOptions(str(tmp_path), "t", num_kept_ckpts=2).retention == KeepLatest(2)


def test_manager_takes_options_or_arguments_not_both(tmp_path):
    manager = CheckpointManager()
    model, opt, sched = make_training(seed=3)
    train_steps(model, opt, sched, 1, seed=3)
    ckpt = str(tmp_path / "ckpt")
    manager.save(SaveOptions(ckpt, "a", model=model))
    manager.save(ckpt, "b", model=model, num_kept_ckpts=1)
    manager.wait_retention()  # deletions run on the writer thread, after the commit
    assert sorted(os.listdir(ckpt)) == [".nxd-tags.json", "b"]
    with pytest.raises(TypeError, match="either a SaveOptions or the save's arguments"):
        manager.save(SaveOptions(ckpt, "c"), use_xser=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_xsr'"):
        manager.save(ckpt, "c", use_xsr=True)
    target = TinyMLP()
    manager.load(LoadOptions(ckpt, model=target))
    for name, value in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], value)
    with pytest.raises(TypeError, match="either a LoadOptions or the load's arguments"):
        manager.load(LoadOptions(ckpt), "b")
    manager.finalize()


def test_an_unknown_or_extra_argument_is_refused_as_python_would(tmp_path):
    """The signature comes from the options' fields: an unknown keyword is named with the accepted ones, and only
    NxD's parameters are positional (in the functions and in the options)."""
    unknown = r"^save_checkpoint\(\) got an unexpected keyword argument 'use_xsr'; "
    accepted = r"the accepted ones are checkpoint_dir_str, tag, model, optimizer, .*, device_snapshot_budget$"
    with pytest.raises(TypeError, match=unknown + accepted):
        api.save_checkpoint(str(tmp_path), "t", use_xsr=True)
    with pytest.raises(TypeError, match=r"^load_checkpoint\(\) got an unexpected keyword argument 'stict'; .* path, "):
        api.load_checkpoint(str(tmp_path), stict=True)
    with pytest.raises(TypeError, match=r"takes from 2 to 13 positional arguments \(NxD's\) but 14 were given"):
        api.save_checkpoint(str(tmp_path), "t", *([None] * 4), *([False] * 8))
    with pytest.raises(TypeError, match=r"takes from 1 to 8 positional arguments \(NxD's\) but 9 were given"):
        api.load_checkpoint(str(tmp_path), *([None] * 8))
    with pytest.raises(TypeError, match=r"^save_checkpoint\(\) missing a required argument: 'tag'"):
        api.save_checkpoint(str(tmp_path))
    with pytest.raises(TypeError):
        SaveOptions(str(tmp_path), "t", *([None] * 4), 8, *([False] * 6), None)  # rank_state is keyword-only
    assert not os.listdir(tmp_path)
