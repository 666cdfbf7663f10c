"""The prefix cache on the tiny model (fp32, CPU): training from it gives the uncached adapter, the wavefront
writes what the sequential pass writes, a killed pass redoes only its missing shards, and a cache that is not
this run's (other inputs, incomplete, too big for the disk) is refused with what differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsr1kit import params as P
from dsr1kit.cluster.rendezvous import free_port
from dsr1kit.steps.hari_configs import hari_run, prefix_setup
from dsr1kit.train import prefix
from dsr1kit.train.prefix import shards

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"sample_limit": 96, "max_steps": 8, "save_every": 4, "log_every": 2}
# Max relative difference, per adapter tensor. The cached and uncached paths batch the frozen layers'
# fp32 sums differently; Adam turns last-bit differences into relative ones on small weights, by an amount
# that depends on the weights: ≤ 1e-6 on the tiny model as pre-trained on one machine, 3.5e-6 on another's
# (the embedded model is pre-trained where it runs). A wrong cache is ~1e-2 (below): 1e-5 tells them apart.
TOLERANCE = 1e-5
# Two ranks add an all-reduce whose fp32 sums round differently again; Adam turns those last-bit
# differences into relative ones on small weights (measured 1.6e-5 on the tiny model; cached states
# off by a factor 1 + 1e-3 give 2.4e-2).
TOLERANCE_TWO_RANKS = 1e-4


def _params(run_dir: Path, **changes) -> P.HariParams:
    return P.load("20_hari_training", overrides={"run_dir": str(run_dir), **SMALL, **changes})


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)


def _run(run_dir: Path, **changes) -> dict:
    from dsr1kit.steps.hari_training import run

    return run(_params(run_dir, **changes))


@pytest.fixture(scope="module")
def uncached(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uncached")
    _run(run_dir)
    return run_dir


def test_training_from_the_cache_gives_the_uncached_adapter_and_a_second_run_reuses_it(tmp_path, uncached):
    cache = tmp_path / "cache"
    first = _run(tmp_path / "a", prefix_cache=str(cache), prefix_shard_mib=1.0)
    assert first["prefix_cache"]["shards"] >= 3 and first["prefix_cache"]["built_here"]["shards_built"] >= 3
    diff = _max_relative_difference(_adapter(uncached), _adapter(tmp_path / "a"))
    assert diff <= TOLERANCE, diff
    # the loaded model is the adapted layer, norm and lm_head only; the adapter names the full model's layer
    assert first["model"]["loaded_layers"] == "2-2 of 3"
    assert first["lora"]["modules"] == [
        "model.layers.2.self_attn.q_a_proj",
        "model.layers.2.self_attn.q_b_proj",
    ]
    # the KL's reference computed once per sample, beside the prefix cache, and read by every step
    ref = first["reference_cache"]
    assert (
        ref["folder"].startswith(str(cache / "reference"))
        and ref["samples"] == first["prefix_cache"]["samples"]
    )
    assert ref["built_here"]["shards_built"] == ref["shards"] == first["prefix_cache"]["shards"]
    second = _run(tmp_path / "b", prefix_cache=str(cache), prefix_shard_mib=1.0)
    assert second["prefix_cache"]["built_here"] is None  # a cache hit: nothing rebuilt
    assert second["reference_cache"]["built_here"] is None
    assert _max_relative_difference(_adapter(tmp_path / "a"), _adapter(tmp_path / "b")) == 0.0
    # each step computing the reference itself gives the same adapter
    third = _run(tmp_path / "c", prefix_cache=str(cache), prefix_shard_mib=1.0, reference_cache=False)
    assert third["reference_cache"] is None
    diff = _max_relative_difference(_adapter(tmp_path / "a"), _adapter(tmp_path / "c"))
    assert diff <= TOLERANCE, diff


def test_reference_states_are_what_a_step_computes_and_a_wrong_one_is_refused(tmp_path, tiny_setup):
    """The reference pass stores, per sample, the adapted layers' output with the adapter off, as the step
    computes it on that sample's own batch; a folder holding another run's reference is refused."""
    from dsr1kit.train.hari import prefix_forward, reference_states, run_layers
    from dsr1kit.train.loop import collate
    from dsr1kit.train.prefix.reference import (
        fill_reference_cache,
        prepare_reference_layout,
        reference_fingerprint,
    )

    model, examples, pad_id, cache = _reference_setup(tmp_path, tiny_setup)
    folder, fp, built = fill_reference_cache(
        model, cache, examples, FIRST, pad_id, "adapted layers float32", tokens_per_batch=512
    )
    assert built["shards_built"] == len(cache.layout.shards)
    ref = prefix.PrefixCache(folder, fp)
    vocab = model.get_input_embeddings().num_embeddings
    for i in (0, len(examples) // 2, len(examples) - 1):  # one sample alone, as a step of batch 1 sees it
        batch = collate([examples[i]], pad_id, vocab)
        batch["inputs_embeds"] = cache.batch([i], len(examples[i].input_ids))
        want = reference_states(model, batch, FIRST)[0]
        assert torch.allclose(ref.hidden(i), want, rtol=1e-5, atol=1e-6), i
    assert not torch.allclose(ref.hidden(0), cache.hidden(0), atol=1e-3)  # the adapted layers did run
    batch = collate([examples[0]], pad_id, vocab)
    batch["inputs_embeds"] = cache.batch([0], len(examples[0].input_ids))
    hidden, args, kwargs = prefix_forward(model, batch, FIRST)
    with torch.no_grad():
        student = run_layers(model, FIRST, hidden, args, kwargs)[0]
    assert not torch.allclose(ref.hidden(0), student, atol=1e-4)  # with the adapter off
    with pytest.raises(prefix.PrefixCacheError, match="reference_of_adapted_layers"):
        prepare_reference_layout(
            folder, reference_fingerprint(cache.layout.fingerprint, "adapted layers nf4"), cache.layout
        )


FIRST = 2  # the tiny model's last layer is the adapted one


def _reference_setup(tmp_path: Path, setup):
    """A prefix cache of the tiny setup's samples, and a fresh copy of the model with a non-zero adapter."""
    from dsr1kit.model.load import load_model
    from dsr1kit.model.lora import apply_lora
    from dsr1kit.steps.hari_configs import load_config, lora_config

    p, tokenizer, examples, base = setup
    folder = tmp_path / "prefix"
    layout = _layout(folder, setup)
    prefix.build(base, examples, folder, layout, FIRST, tokenizer.pad_token_id, progress=False)
    model, _ = apply_lora(load_model(load_config(p), tokenizer=tokenizer).model, lora_config(p))
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.normal_(std=0.05)
    return model, examples, tokenizer.pad_token_id, prefix.PrefixCache(folder)


def test_a_failed_reference_pass_stops_the_waiting_tasks_and_names_that_pass(
    tmp_path, tiny_setup, monkeypatch
):
    """Task 0's share fails midway: its marker names the reference pass, a task waiting for the whole cache
    raises that error instead of hanging, and the shards written before the failure stay whole; the rerun
    removes a half-written shard's temp file and builds only what is missing."""
    from dsr1kit.train.prefix import reference

    model, examples, pad_id, cache = _reference_setup(tmp_path, tiny_setup)
    calls = {"n": 0}
    real = reference.reference_states

    def fails_on_the_second_shard(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > len(reference.length_batches(cache.layout.shards[0].lengths, 512)):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "reference_states", fails_on_the_second_shard)
    assert len(cache.layout.shards) >= 2
    with pytest.raises(RuntimeError, match="simulated"):
        reference.fill_reference_cache(model, cache, examples, FIRST, pad_id, "float32", 512, progress=False)
    folder = reference.reference_folder(
        cache.directory, reference.reference_fingerprint(cache.layout.fingerprint, "float32")
    )
    first, second = (folder / cache.layout.shards[k].file for k in (0, 1))
    assert first.is_file() and not second.is_file()
    with pytest.raises(
        prefix.PrefixCacheError, match=r"the reference pass failed on task0: RuntimeError: CUDA out"
    ):
        prefix.wait_for_shards(folder, poll_s=0.01)
    (folder / "failed-task0").write_text("RuntimeError: written by an older kit\n")  # names no pass
    with pytest.raises(prefix.PrefixCacheError, match=r"a pass failed on task0: RuntimeError: written"):
        prefix.wait_for_shards(folder, poll_s=0.01)

    # the rerun: the half-written shard a kill left is removed, the whole one is kept, the marker cleared
    stale = folder / f".{second.name}.99999.tmp"
    stale.write_bytes(b"half a shard")
    kept = first.stat().st_mtime_ns
    monkeypatch.setattr(reference, "reference_states", real)
    _, _, built = reference.fill_reference_cache(
        model, cache, examples, FIRST, pad_id, "float32", 512, progress=False
    )
    assert built["shards_built"] == len(cache.layout.shards) - 1
    assert not stale.exists() and not (folder / "failed-task0").exists()
    assert first.stat().st_mtime_ns == kept
    prefix.wait_for_shards(folder, poll_s=0.01)


def test_a_cached_run_resumes_from_its_checkpoint_and_may_not_switch_the_cache(tmp_path, uncached):
    import shutil

    from dsr1kit.train.checkpoint import ResumeMismatch

    cache = str(tmp_path / "cache")
    _run(tmp_path / "whole", prefix_cache=cache)
    run_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoints", run_dir / "checkpoints")
    shutil.rmtree(run_dir / "checkpoints" / "step-0000008")
    (run_dir / "checkpoints" / "latest").write_text("step-0000004")
    info = _run(run_dir, prefix_cache=cache)
    assert info["resumed_from"] == 4 and info["steps_done"] == 8
    assert _max_relative_difference(_adapter(tmp_path / "whole"), _adapter(run_dir)) == 0.0
    assert _max_relative_difference(_adapter(uncached), _adapter(run_dir)) <= TOLERANCE
    # a checkpoint made without the cache: on GPUs the cache changes the ranks and the adapted layer's precision
    plain = tmp_path / "plain"
    shutil.copytree(uncached / "checkpoints", plain / "checkpoints")
    with pytest.raises(ResumeMismatch, match="prefix_cache: 'off' → "):
        _run(plain, prefix_cache=cache)


def _two_ranks(run_dir: Path, *extra: str) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "dsr1kit",
        "train",
        *[x for k, v in SMALL.items() for x in ("-p", k, str(v))],
        *extra,
        "--run-dir",
        str(run_dir),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]


def test_two_gloo_ranks_from_the_cache_give_the_uncached_two_rank_adapter(tmp_path):
    cache = tmp_path / "cache"
    _two_ranks(tmp_path / "plain")
    _two_ranks(tmp_path / "cached", "-p", "prefix_cache", str(cache), "-p", "prefix_shard_mib", "1.0")
    diff = _max_relative_difference(_adapter(tmp_path / "plain"), _adapter(tmp_path / "cached"))
    assert diff <= TOLERANCE_TWO_RANKS, diff
    info = json.loads((tmp_path / "cached" / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["ranks_agree"]
    # each rank wrote its own share of the shards (shard i to rank i % 2), then both read all of them
    passes = {
        json.loads(line)["task"]: json.loads(line)
        for f in cache.glob("passes-task*.jsonl")
        for line in f.read_text().splitlines()
    }
    layout = json.loads((cache / prefix.INDEX).read_text())
    assert sorted(passes) == [0, 1]
    assert sum(row["shards_built"] for row in passes.values()) == len(layout["shards"]) >= 2


# -- the pass itself ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup():
    from dsr1kit.model.load import load_model
    from dsr1kit.steps.hari_configs import load_config
    from dsr1kit.train.hari_run import load_tokenizer, prepare_data

    p = _params(Path("/nonexistent"), sample_limit=40)
    tokenizer = load_tokenizer(hari_run(p))
    data = prepare_data(hari_run(p), tokenizer)
    model = load_model(load_config(p), tokenizer=tokenizer).model.eval()
    return p, tokenizer, data.encoded.examples, model


def _layout(directory: Path, setup, shard_mib: float = 0.25, tokens_per_batch: int = 512, **fp_changes):
    p, tokenizer, examples, model = setup
    fp = {
        **prefix.fingerprint(prefix_setup(p).key, str(model.config._name_or_path), tokenizer, examples, 2),
        **fp_changes,
    }
    return prefix.prepare_layout(
        directory, fp, examples, model.config.hidden_size, p.dtype, tokens_per_batch, shard_mib
    )


def _shards(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("shard-*.safetensors")):
        out.update(load_file(f))
    return out


def test_wavefront_over_stages_writes_the_same_tensors_as_the_sequential_pass(tmp_path, tiny_setup):
    _, tokenizer, examples, model = tiny_setup
    assert prefix.stage_bounds(model, 2, stages=2) == [0, 1, 2]
    seq, wave = tmp_path / "seq", tmp_path / "wave"
    for folder, pipeline in ((seq, False), (wave, True)):
        layout = _layout(folder, tiny_setup)
        stats = prefix.build(
            model,
            examples,
            folder,
            layout,
            2,
            tokenizer.pad_token_id,
            pipeline=pipeline,
            stages=2,
            progress=False,
        )
        assert stats.shards_built == len(layout.shards) >= 2
    assert stats.stages == [0, 1, 2]
    a, b = _shards(seq), _shards(wave)
    assert a.keys() == b.keys() == {str(i) for i in range(len(examples))}
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    assert all(
        a[str(i)].shape == (len(e.input_ids), model.config.hidden_size) for i, e in enumerate(examples)
    )


def test_cached_states_are_what_the_first_adapted_layer_receives(tmp_path, tiny_setup):
    from dsr1kit.data.labels import collate
    from dsr1kit.train.hari import prefix_forward

    _, tokenizer, examples, model = tiny_setup
    layout = _layout(tmp_path, tiny_setup)
    prefix.build(model, examples, tmp_path, layout, 2, tokenizer.pad_token_id, progress=False)
    cache = prefix.PrefixCache(tmp_path)
    for i, e in enumerate(examples[:5]):
        batch = collate([e], tokenizer.pad_token_id, model.config.vocab_size)
        with torch.no_grad():
            hidden, _, _ = prefix_forward(model, batch, 2)
        torch.testing.assert_close(cache.hidden(i), hidden[0], rtol=1e-5, atol=1e-5)


def test_samples_that_share_an_id_keep_their_own_states(tmp_path, tiny_setup):
    """Datasets repeat ids across splits and files: the cache names samples by position."""
    import dataclasses

    p, tokenizer, examples, model = tiny_setup
    twice = examples[:10] + [
        dataclasses.replace(e, input_ids=e.input_ids[:-3], labels=e.labels[:-3]) for e in examples[:10]
    ]
    fp = prefix.fingerprint(prefix_setup(p).key, str(model.config._name_or_path), tokenizer, twice, 2)
    layout = prefix.prepare_layout(tmp_path, fp, twice, model.config.hidden_size, p.dtype, 512, 0.25)
    prefix.build(model, twice, tmp_path, layout, 2, tokenizer.pad_token_id, progress=False)
    cache = prefix.PrefixCache(tmp_path)
    assert [cache.hidden(i).shape[0] for i in (0, 10)] == [
        len(twice[0].input_ids),
        len(twice[0].input_ids) - 3,
    ]


def test_an_error_in_a_stage_thread_reaches_the_caller(tiny_setup, monkeypatch):
    from dsr1kit.model.lora import decoder_layers

    _, tokenizer, examples, model = tiny_setup

    def broken(*args, **kwargs):
        raise RuntimeError("stage 1 broke")

    monkeypatch.setattr(decoder_layers(model)[1], "forward", broken)
    with pytest.raises(RuntimeError, match="stage 1 broke"):
        list(
            prefix.wavefront_pass(model, [examples[:2], examples[2:4]], 2, tokenizer.pad_token_id, [0, 1, 2])
        )


def test_a_killed_pass_redoes_only_its_missing_shards(tmp_path, tiny_setup, monkeypatch):
    _, tokenizer, examples, model = tiny_setup
    clean = tmp_path / "clean"
    prefix.build(
        model, examples, clean, _layout(clean, tiny_setup), 2, tokenizer.pad_token_id, progress=False
    )

    folder = tmp_path / "killed"
    layout = _layout(folder, tiny_setup)
    real_save, calls = shards.save_file, []

    def dies_on_the_third_shard(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"half a shard")  # what a kill mid-write leaves
            raise KeyboardInterrupt("killed")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(shards, "save_file", dies_on_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        prefix.build(model, examples, folder, layout, 2, tokenizer.pad_token_id, progress=False)
    assert len(list(folder.glob("shard-*.safetensors"))) == 2 and list(folder.glob(".shard-*.tmp"))
    with pytest.raises(
        prefix.PrefixCacheError, match=f"incomplete: {len(layout.shards) - 2} of {len(layout.shards)}"
    ):
        prefix.PrefixCache(folder)

    monkeypatch.setattr(shards, "save_file", real_save)
    again = prefix.build(
        model, examples, folder, prefix.CacheLayout.read(folder), 2, tokenizer.pad_token_id, progress=False
    )
    assert (again.shards_reused, again.shards_built) == (2, len(layout.shards) - 2)
    assert not list(folder.glob(".shard-*.tmp"))
    a, b = _shards(clean), _shards(folder)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tasks_write_disjoint_shares(tmp_path, tiny_setup):
    _, tokenizer, examples, model = tiny_setup
    layout = _layout(tmp_path, tiny_setup)
    runs = [
        prefix.build(
            model, examples, tmp_path, layout, 2, tokenizer.pad_token_id, task=t, tasks=2, progress=False
        )
        for t in (0, 1)
    ]
    assert [r.shards_built for r in runs] == [len(layout.shards[0::2]), len(layout.shards[1::2])]
    assert runs[0].shards_other_tasks == len(layout.shards[1::2])
    assert len(prefix.PrefixCache(tmp_path).where) == len(examples)


def test_a_relative_cache_folder_means_the_project_root_wherever_it_runs(monkeypatch, tmp_path):
    from dsr1kit.run.paths import PROJECT_ROOT

    monkeypatch.chdir(tmp_path)  # papermill runs notebooks in notebooks/, jobs in the project root
    assert prefix.prefix_cache_folder("runs/cache", {}) == PROJECT_ROOT / "runs" / "cache"


def test_a_cache_for_other_inputs_is_refused_field_by_field(tmp_path, tiny_setup):
    _layout(tmp_path, tiny_setup)
    with pytest.raises(prefix.PrefixCacheError) as err:
        _layout(tmp_path, tiny_setup, max_len="128", first_adapted_layer="1")
    message = str(err.value)
    assert "first_adapted_layer: cached '2', this run '1'" in message
    assert "max_len: cached '256', this run '128'" in message
    assert "dtype" not in message and "tokenizer" not in message  # only what differs


def test_a_run_whose_data_changed_does_not_reuse_the_cache(tmp_path, tiny_setup):
    p, tokenizer, examples, model = tiny_setup
    now = prefix.fingerprint(
        prefix_setup(p).key, str(model.config._name_or_path), tokenizer, examples[:-1], 2
    )
    before = prefix.fingerprint(prefix_setup(p).key, str(model.config._name_or_path), tokenizer, examples, 2)
    assert [line.split(":")[0] for line in prefix.differences(before, now)] == ["samples"]
    assert prefix.fingerprint_id(now) != prefix.fingerprint_id(before)  # auto: another folder


def test_too_little_disk_is_refused_before_anything_is_written(tmp_path, tiny_setup, monkeypatch):
    import shutil

    _, tokenizer, examples, model = tiny_setup
    layout = _layout(tmp_path, tiny_setup)
    need = layout.tokens * layout.bytes_per_token
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 10**12, need // 2))
    with pytest.raises(
        prefix.PrefixCacheError,
        match=rf"needs {need / 2**30:.2f} GiB more .* has "
        rf"{need / 2 / 2**30:.2f} GiB free",
    ):
        prefix.build(model, examples, tmp_path, layout, 2, tokenizer.pad_token_id, progress=False)
    assert not list(tmp_path.glob("shard-*"))


def test_length_batches_respect_the_token_budget_and_sort_by_length():
    lengths = [5, 40, 12, 40, 7, 100, 3]
    batches = prefix.length_batches(lengths, 80)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [[lengths[i] for i in b] for b in batches] == [[100], [40, 40], [12, 7, 5, 3]]
    assert all(len(b) * max(lengths[i] for i in b) <= 80 or len(b) == 1 for b in batches)


# -- the model that trains from the cache -------------------------------------------------------------


def test_the_adapted_layers_alone_give_the_full_models_logits(tiny_dir):
    from transformers import AutoModelForCausalLM

    from dsr1kit.model.partial import Passthrough, load_adapted_layers
    from dsr1kit.train.hari import prefix_forward

    full = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    part = load_adapted_layers(tiny_dir, 2, "cpu", dtype=torch.float32)
    assert [type(m) for m in part.model.layers[:2]] == [Passthrough, Passthrough]
    assert part.model.embed_tokens.weight.numel() == 0
    ids = torch.randint(0, 500, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    with torch.no_grad():
        hidden, _, _ = prefix_forward(full, {"input_ids": ids, "attention_mask": mask}, 2)
        expected = full(input_ids=ids, attention_mask=mask).logits
        got = part(inputs_embeds=hidden, attention_mask=mask).logits
    assert torch.equal(expected[mask.bool()], got[mask.bool()])


def test_r1_from_the_cache_fits_one_80gb_gpu_where_the_whole_model_does_not():
    from dsr1kit.plan import Machine, hari_plan, prefix_pass_plan
    from dsr1kit.steps.hari_configs import plan_inputs

    p = P.load("20_hari_training", ["params/r1-671b-2x8h100/20_hari_training.yaml"])
    one_gpu = Machine(1, 80 * 2**30, 1000 * 2**30)
    assert not hari_plan(plan_inputs(p), one_gpu).fits
    cached = hari_plan(plan_inputs(p.model_copy(update={"prefix_cache": "auto"})), one_gpu)
    assert cached.fits and "prefix cache" in cached.step
    weights = cached.devices[0].parts["weights"] / 2**30
    assert 20 < weights < 26  # one MoE layer in bf16 (~21 GiB) + lm_head and norm
    assert prefix_pass_plan(plan_inputs(p), Machine(8, 80 * 2**30, 1000 * 2**30)).fits


def test_the_cache_needs_the_fast_path():
    with pytest.raises(P.ParamsError, match="prefix_cache 'auto' needs hari_impl 'fast'"):
        P.load("20_hari_training", overrides={"prefix_cache": "auto", "hari_impl": "naive"})
    with pytest.raises(P.ParamsError, match="give off, auto, or a folder"):
        P.load("20_hari_training", overrides={"prefix_cache": " "})
