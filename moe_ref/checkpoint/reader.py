"""A safetensors checkpoint as one set of tensors: a ``.safetensors`` file, or a folder with one file or shards and
their ``model.safetensors.index.json``; headers are read when opened, tensors only when asked for. Or tensors already
in memory (``{name: tensor}``, e.g. a loaded model's blocks), read through the same interface without a copy.

    file | folder (+ index) | {name: tensor}  --CheckpointReader-->  names, shape, dtype, read, read_rows

Checked: a missing path (LOAD004), truncated or non-safetensors files (LOAD010), shards named in the index but
absent (LOAD011), a corrupt index (LOAD012), index names that leave the checkpoint folder (LOAD013). The last check
is on the NAMES the index gives (an absolute path, a ``..`` component), not on where a shard file's link points: in
the Hugging Face hub cache every file of ``snapshots/<commit>/`` is a symlink into ``../../blobs/`` (or an absolute
link into a shared store), and those are the checkpoint as published."""
from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open

from moe_ref.core.errors import (
    CheckpointNotFoundError,
    CorruptIndexError,
    CorruptSafetensorsError,
    MissingShardError,
    UnsafeShardPathError,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors' dtype strings of the torch dtypes a checkpoint holds (the in-memory reader answers ``dtype`` with them)
_SAFETENSORS_DTYPE_OF = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                         torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                         torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                         torch.bool: "BOOL"}


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint (one file or shards). Use as a context manager.

    Only headers are read on open; ``read``/``read_rows`` read one tensor (or a row block of it).

    Args:
        path: a ``.safetensors`` file, a checkpoint folder, or a mapping ``{name: tensor}`` of tensors already in
            memory: then ``read`` returns the tensor itself and ``read_rows`` a view of its rows (no copy), and
            ``files`` is empty.
    """

    def __init__(self, path: str | os.PathLike | Mapping[str, torch.Tensor]):
        self._tensors: dict[str, torch.Tensor] | None = None
        if isinstance(path, Mapping):
            self.path = None
            self._tensors = {name: t.detach() for name, t in path.items()}
            self.file_of: dict[str, Path] = {}
        else:
            self.path = Path(path)
            self.file_of = self._weight_map(self.path)
        self.files: list[Path] = sorted(set(self.file_of.values()))
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    @staticmethod
    def _weight_map(path: Path) -> dict[str, Path]:
        if path.is_file():
            return {name: path for name in _keys(path)}
        if not path.is_dir():
            raise CheckpointNotFoundError(f"checkpoint path {str(path)!r} does not exist", path=str(path))
        index = path / INDEX_FILE
        if index.exists():
            return _index_weight_map(path, index)
        files = [path / SINGLE_FILE] if (path / SINGLE_FILE).exists() else sorted(path.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in path.iterdir())[:8]
            raise CheckpointNotFoundError(
                f"folder {str(path)!r} holds no *.safetensors file and no {INDEX_FILE} (it holds: {found})",
                path=str(path))
        return {name: f for f in files for name in _keys(f)}

    def _handle(self, name: str):
        file = self.file_of[name]
        if file not in self._handles:
            with _corrupt_file_errors(file):
                self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in (self.file_of if self._tensors is None else self._tensors)

    def names(self) -> list[str]:
        return list(self.file_of if self._tensors is None else self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._tensors is not None:
            return tuple(self._tensors[name].shape)
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors dtype string, e.g. ``"BF16"``, ``"F8_E4M3"``."""
        if self._tensors is not None:
            dtype = self._tensors[name].dtype
            return _SAFETENSORS_DTYPE_OF.get(dtype, str(dtype).removeprefix("torch."))
        return self._handle(name).get_slice(name).get_dtype()

    def read(self, name: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[name]
        handle = self._handle(name)
        with _corrupt_file_errors(self.file_of[name]):
            return handle.get_tensor(name)

    def read_rows(self, name: str, first: int, count: int) -> torch.Tensor:
        """Rows ``[first, first + count)`` of dim 0, reading only those bytes (in memory: a view of them)."""
        if self._tensors is not None:
            return self._tensors[name][first:first + count]
        handle = self._handle(name)
        with _corrupt_file_errors(self.file_of[name]):
            return handle.get_slice(name)[first:first + count]

    def describe_files(self, limit: int = 3) -> str:
        if self._tensors is not None:
            return f"{len(self._tensors)} tensors in memory"
        names = [str(f) for f in self.files[:limit]]
        more = f" and {len(self.files) - limit} more" if len(self.files) > limit else ""
        return ", ".join(names) + more


def _keys(file: Path) -> list[str]:
    with _corrupt_file_errors(file), safe_open(str(file), framework="pt", device="cpu") as handle:
        return list(handle.keys())


@contextmanager
def _corrupt_file_errors(file: Path):
    """Turn safetensors' header/data errors on ``file`` into ``CorruptSafetensorsError`` (LOAD010) naming it."""
    try:
        yield
    except (SafetensorError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        size = file.stat().st_size if file.exists() else 0
        raise CorruptSafetensorsError(
            f"{str(file)!r} ({size} bytes) is truncated or not a safetensors file ({type(err).__name__}: {err}); "
            f"download it again", path=str(file)) from None


def _index_weight_map(folder: Path, index: Path) -> dict[str, Path]:
    """``{tensor name: shard path}`` of ``index``, every shard a file inside ``folder``.

    Raises CorruptIndexError (LOAD012), UnsafeShardPathError (LOAD013), MissingShardError (LOAD011).
    """
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise CorruptIndexError(f"{str(index)!r} is not a JSON object with a 'weight_map' ({err}); download it "
                                f"again, or delete it to read every *.safetensors file of the folder",
                                path=str(index)) from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CorruptIndexError(f"{str(index)!r}: 'weight_map' must map tensor names to shard file names, got "
                                f"{str(weight_map)[:120]}; download it again", path=str(index))
    outside = sorted({f for f in weight_map.values() if _leaves_folder(f)})
    if outside:
        raise UnsafeShardPathError(f"{str(index)!r} names shard files outside the checkpoint folder {str(folder)!r}: "
                                   f"{outside[:4]}; shards must be file names inside the folder", path=str(index))
    missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
    if missing:
        raise MissingShardError(
            f"{str(index)!r} names shard files that are missing: {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}; download/copy every shard", path=str(folder))
    return {name: folder / f for name, f in weight_map.items()}


def _leaves_folder(name: str) -> bool:
    """Whether an index's shard name points out of the folder it sits in: empty, absolute (POSIX or Windows, a drive
    or a share), or with a ``..`` component. Judged on the name only: a shard that is a link (the hub cache's
    ``snapshots/<commit>/x -> ../../blobs/<hash>``) is where the index says it is."""
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    return (not name or posix.is_absolute() or windows.is_absolute() or bool(windows.drive)
            or ".." in posix.parts or ".." in windows.parts)
