"""``MegaMoE.from_pretrained``: a loaded ``MegaMoE`` for one MoE layer of a checkpoint named by a folder or a repo id
(also ``moe_ref.integrations.from_pretrained``).

    name_or_path --checkpoint.hub.resolve_checkpoint (offline: the hub cache, never the network)--> folder
      --every rank of the group agrees it resolved (else the same coded error on every rank)-->
      MegaMoE(folder/config.json, group, **layer_options) --load_hf_weights(folder, layer_idx)--> layer
"""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from moe_ref.checkpoint.hub import resolve_checkpoint
from moe_ref.core.errors import MoERefError, error_class
from moe_ref.ep.distributed import gather_objects


def from_pretrained(layer_class: type, name_or_path: str | os.PathLike, layer_idx: int, *,
                    group: dist.ProcessGroup | None = None, revision: str | None = None,
                    cache_dir: str | os.PathLike | None = None, prefix: str | None = None,
                    progress: bool | None = None, **layer_options):
    """Build and load MoE layer ``layer_idx`` of a checkpoint (collective over ``group``, like ``MegaMoE``).

    Args:
        layer_class: ``MegaMoE`` (or a subclass: ``MegaMoE.from_pretrained`` passes its class).
        name_or_path: a checkpoint folder (config.json + safetensors, sharded or not) or ``.safetensors`` file with
            its config.json beside it, or a repo id (``"org/name"``) already in the local hub cache.
        layer_idx: the decoder layer (an MoE layer).
        group: the EP process group, or None for one process.
        revision: for a repo id: branch, tag or commit (default ``main``).
        cache_dir: for a repo id: the hub cache folder (default: huggingface_hub's, ``HF_HUB_CACHE``/``HF_HOME``).
        prefix: the text before the layer number in tensor names (None: detected).
        progress: a progress bar over this rank's experts (None: rank 0 only).
        layer_options: ``MegaMoE``'s keyword options (``num_max_tokens_per_rank``, ``overflow``, ``dtype``,
            ``device``, ``experts_backend``...).

    Returns:
        The ``MegaMoE`` with this rank's experts loaded.

    Raises:
        On every rank alike, where any rank could not resolve the name: RepoNotCachedError (LOAD021, naming the
        cache folder and the ``hf download`` command), IncompleteSnapshotError (LOAD023), CheckpointNotFoundError
        (LOAD004), OptionalDependencyError (ENV022); then ``MegaMoE``'s and ``load_hf_weights``' errors.
    """
    path = _resolve_on_every_rank(name_or_path, revision, cache_dir, group)
    folder = path if path.is_dir() else path.parent
    layer = layer_class(folder, group, **layer_options)
    return layer.load_hf_weights(path, layer_idx, prefix=prefix, progress=progress)


def _resolve_on_every_rank(name_or_path, revision, cache_dir, group) -> Path:
    """``resolve_checkpoint`` on this rank, then one agreement: where any rank failed, every rank raises (its own
    error, or the first failing rank's code and message): the layer's construction is collective, so a rank raising
    alone would leave its peers waiting there."""
    path, error = None, None
    try:
        path = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    except MoERefError as err:
        error = err
    failures = [(rank, f) for rank, f in enumerate(gather_objects(error and (error.code, error.message), group)) if f]
    if error is not None:
        raise error
    if failures:
        rank, (code, message) = failures[0]
        raise error_class(code)(f"rank {rank}: {message}")
    return path
