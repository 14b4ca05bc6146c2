"""Checkpoints where the Hugging Face hub cache keeps them: ``models--org--name/snapshots/<commit>/`` whose files are
links into ``../../blobs/`` (or absolute links into a shared store), read by ``CheckpointReader`` and resolved from a
repo id OFFLINE by ``moe_ref.integrations.from_pretrained`` (huggingface_hub's own resolver, never the network)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from moe_ref.checkpoint.hub import resolve_checkpoint
from moe_ref.checkpoint.loading import load_moe_weights
from moe_ref.checkpoint.reader import CheckpointReader
from moe_ref.checkpoint.synthetic import write_synthetic_checkpoint
from moe_ref.core.config import MoEConfig, preset
from moe_ref.core.errors import (CheckpointNotFoundError, IncompleteSnapshotError, RepoNotCachedError,
                                 UnsafeShardPathError)
from moe_ref import MegaMoE, integrations
from moe_ref.reference import reference_moe
from moe_ref.testing import assert_close

pytestmark = pytest.mark.unit

LAYER = 1
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _synthetic(folder: Path, num_shards: int = 2):
    cfg = preset("tiny-deepseek-v3")
    weights = write_synthetic_checkpoint(folder, cfg, layer_idx=LAYER, seed=3, dtype=torch.float32,
                                         layout="fused", num_shards=num_shards)
    return MoEConfig.from_hf_config(folder), weights


def hub_cache(tmp_path: Path, repo_id: str = "org/tiny", *, absolute_links: bool = False,
              revision: str = "main", num_shards: int = 2):
    """A hub cache under ``tmp_path/hub`` holding ``repo_id``: each file stored once under its sha256 (in the repo's
    ``blobs/``, or in ``tmp_path/store`` for absolute links) and linked from ``snapshots/<commit>/``."""
    staging = tmp_path / "staging"
    cfg, weights = _synthetic(staging, num_shards)
    cache = tmp_path / "hub"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    store = tmp_path / "store" if absolute_links else repo / "blobs"
    store.mkdir(parents=True, exist_ok=True)
    for file in sorted(staging.iterdir()):
        blob = store / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.move(file, blob)
        target = blob if absolute_links else os.path.relpath(blob, snapshot)
        (snapshot / file.name).symlink_to(target)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(COMMIT)
    return cache, snapshot, cfg, weights


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HOME / HF_HUB_CACHE at ``tmp_path`` (the env for a fresh process; huggingface_hub read them at import,
    so its constant too), and offline mode on: a test that reached the network would fail."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


@pytest.mark.parametrize("absolute_links", [False, True], ids=["relative-links-to-blobs", "absolute-links-to-store"])
def test_sharded_checkpoint_in_the_hub_cache_loads(tmp_path, absolute_links):
    _, snapshot, cfg, expected = hub_cache(tmp_path, absolute_links=absolute_links)
    assert all((snapshot / f).is_symlink() for f in os.listdir(snapshot))  # the layout under test
    with CheckpointReader(snapshot) as ckpt:
        assert len(ckpt.files) == 2 and all(f.parent == snapshot for f in ckpt.files)
    loaded = load_moe_weights(snapshot, cfg, LAYER)
    for name in ("gate_weight_ED", "gate_up_weight_E2FD", "down_weight_EDF", "bias_E", "shared_down_weight_DS"):
        assert torch.equal(getattr(loaded, name), getattr(expected, name)), f"{name=} {absolute_links=}"


@pytest.mark.parametrize("bad_name", ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                      "C:\\models\\x.safetensors", ""])
def test_an_index_name_leaving_the_folder_is_still_refused(tmp_path, bad_name):
    _, snapshot, _, _ = hub_cache(tmp_path)
    index_link = snapshot / "model.safetensors.index.json"
    index = json.loads(index_link.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = bad_name
    index_link.unlink()
    index_link.write_text(json.dumps(index))
    with pytest.raises(UnsafeShardPathError, match=r"LOAD013.*outside the checkpoint folder"):
        CheckpointReader(snapshot)


def test_a_shard_in_a_subfolder_of_the_checkpoint_is_allowed(tmp_path):
    folder = tmp_path / "ckpt"
    cfg, expected = _synthetic(folder)
    (folder / "shards").mkdir()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for name in sorted(set(index["weight_map"].values())):
        (folder / name).rename(folder / "shards" / name)
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_moe_weights(folder, cfg, LAYER).down_weight_EDF, expected.down_weight_EDF)


def test_from_pretrained_resolves_a_repo_id_through_the_cache_offline(tmp_path, offline_cache):
    """``MegaMoE.from_pretrained`` (the class's own door; ``moe_ref.integrations.from_pretrained`` is the same
    function, used by the other tests here)."""
    cache, snapshot, cfg, weights = hub_cache(tmp_path)
    assert resolve_checkpoint("org/tiny") == snapshot
    layer = MegaMoE.from_pretrained("org/tiny", layer_idx=LAYER, num_max_tokens_per_rank=16, overflow="chunk")
    x_TD = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(layer(x_TD), reference_moe(x_TD, weights, cfg), repo_id="org/tiny")
    layer.destroy()


def test_from_pretrained_takes_a_revision_and_a_cache_dir(tmp_path, offline_cache):
    cache, snapshot, _, _ = hub_cache(tmp_path, revision="v1")
    assert resolve_checkpoint("org/tiny", revision="v1", cache_dir=cache) == snapshot
    assert resolve_checkpoint("org/tiny", revision=COMMIT) == snapshot
    with pytest.raises(RepoNotCachedError, match=r"LOAD021.*'main'.*hf download org/tiny"):
        resolve_checkpoint("org/tiny")


def test_a_repo_id_not_in_the_cache_names_the_cache_and_the_download_command(tmp_path, offline_cache):
    hub_cache(tmp_path)
    with pytest.raises(RepoNotCachedError) as err:
        integrations.from_pretrained("org/absent", layer_idx=LAYER)
    message = str(err.value)
    assert "LOAD021" in message and str(offline_cache) in message and "hf download org/absent" in message
    other = tmp_path / "other_cache"
    with pytest.raises(RepoNotCachedError, match=f"hf download org/absent --revision v2 --cache-dir {other}"):
        resolve_checkpoint("org/absent", revision="v2", cache_dir=other)


def test_a_snapshot_without_weights_is_incomplete(tmp_path, offline_cache):
    _, snapshot, _, _ = hub_cache(tmp_path)
    for file in snapshot.glob("*.safetensors*"):
        file.unlink()
    with pytest.raises(IncompleteSnapshotError, match=r"LOAD023.*no \*\.safetensors.*hf download org/tiny"):
        integrations.from_pretrained("org/tiny", layer_idx=LAYER)


def test_a_local_folder_and_a_missing_path(tmp_path):
    cfg, weights = _synthetic(tmp_path / "ckpt", num_shards=1)
    layer = integrations.from_pretrained(tmp_path / "ckpt", layer_idx=LAYER)
    assert torch.equal(layer.down_weight, weights.down_weight_EDF)
    layer.destroy()
    for missing in (tmp_path / "nope", "./nope", str(tmp_path / "a" / "b")):
        with pytest.raises(CheckpointNotFoundError, match="LOAD004"):
            resolve_checkpoint(missing)


def test_a_repo_id_without_huggingface_hub_is_env022(monkeypatch):
    import sys

    from moe_ref.core.errors import OptionalDependencyError

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub now raises ImportError
    with pytest.raises(OptionalDependencyError, match="ENV022.*huggingface_hub.*local folder"):
        resolve_checkpoint("org/tiny")
