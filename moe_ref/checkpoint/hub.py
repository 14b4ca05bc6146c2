"""A checkpoint named by a local path or a Hugging Face repo id, resolved to a local folder OFFLINE.

    "org/name" | folder | file
      --a path that exists: itself--
      --a repo id: huggingface_hub.snapshot_download(local_files_only=True), the library's own cache resolver
        (refs/<revision> -> snapshots/<commit>/, files linked into ../../blobs/ or a shared store)-->
      the snapshot folder, read by ``CheckpointReader`` like any checkpoint folder

Nothing here downloads: a repo id the cache does not hold is LOAD021 naming the cache folder and the ``hf download``
command; a snapshot the library knows is partial, or one without config.json or safetensors, is LOAD023;
huggingface_hub missing (needed only for repo ids) is ENV022.
"""
from __future__ import annotations

import os
from pathlib import Path

from moe_ref.core.errors import (CheckpointNotFoundError, IncompleteSnapshotError, OptionalDependencyError,
                                 RepoNotCachedError)


def resolve_checkpoint(name_or_path: str | os.PathLike, *, revision: str | None = None,
                       cache_dir: str | os.PathLike | None = None) -> Path:
    """The local folder (or file) of a checkpoint, without touching the network.

    Args:
        name_or_path: a ``.safetensors`` file or checkpoint folder that exists, or a repo id (``"org/name"``)
            resolved through the local hub cache.
        revision: for a repo id: a branch, tag or commit hash (default: ``main``).
        cache_dir: for a repo id: the hub cache folder (default: huggingface_hub's, i.e. ``HF_HUB_CACHE`` or
            ``HF_HOME/hub``).

    Returns:
        The path given, or the repo's snapshot folder ``.../models--org--name/snapshots/<commit>``.

    Raises:
        RepoNotCachedError (LOAD021), IncompleteSnapshotError (LOAD023), OptionalDependencyError (ENV022),
        CheckpointNotFoundError (LOAD004) for a name that is neither an existing path nor a valid repo id.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    if isinstance(name_or_path, os.PathLike) or _looks_like_a_path(str(name_or_path)):
        raise CheckpointNotFoundError(f"checkpoint path {str(name_or_path)!r} does not exist (and is not a repo id "
                                      f"like 'org/name')", path=str(name_or_path))
    return _cached_snapshot(str(name_or_path), revision, cache_dir)


def _looks_like_a_path(name: str) -> bool:
    """A name no repo id can be: absolute, relative with ./ or ../, more than one '/', or a home-folder path."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name)


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> Path:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError as HubIncomplete
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as err:
        raise OptionalDependencyError(
            f"resolving the repo id {repo_id!r} needs huggingface_hub ({err}); pip install huggingface_hub, or pass "
            f"the checkpoint's local folder", package="huggingface_hub") from None
    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    download = _download_command(repo_id, revision, cache_dir)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except HFValidationError as err:
        raise CheckpointNotFoundError(f"{repo_id!r} is neither an existing path nor a valid repo id ({err})",
                                      path=repo_id) from None
    except HubIncomplete as err:
        raise IncompleteSnapshotError(
            f"the hub cache {str(cache)!r} holds part of {repo_id!r} at revision {revision or 'main'!r} only "
            f"({err}); finish the download: {download}", repo_id=repo_id, cache_dir=str(cache)) from None
    except LocalEntryNotFoundError:
        raise RepoNotCachedError(
            f"{repo_id!r} at revision {revision or 'main'!r} is not in the hub cache {str(cache)!r} (moe_ref never "
            f"downloads); download it with: {download} (or set HF_HUB_CACHE / cache_dir= to the cache that holds it, "
            f"or pass the checkpoint's folder)", repo_id=repo_id, cache_dir=str(cache)) from None
    _check_snapshot_files(folder, repo_id, download)
    return folder


def _check_snapshot_files(folder: Path, repo_id: str, download: str) -> None:
    """LOAD023 unless the snapshot has config.json and safetensors weights (a download limited to a few files)."""
    missing = [name for name, present in (("config.json", (folder / "config.json").is_file()),
                                          ("*.safetensors", any(folder.glob("*.safetensors"))))
               if not present]
    if missing:
        raise IncompleteSnapshotError(
            f"the cached snapshot {str(folder)!r} of {repo_id!r} has no {' and no '.join(missing)}; download the "
            f"checkpoint: {download}", repo_id=repo_id, path=str(folder))


def _download_command(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> str:
    options = (f" --revision {revision}" if revision else "") + (f" --cache-dir {cache_dir}" if cache_dir else "")
    return f"hf download {repo_id}{options}"
