"""SymmetricBuffer: the memory of one rank's ``CapacityPlan``, and (when mappable) views of every peer's.

    CapacityPlan --SymmetricBuffer(plan, group, kind)--> my bytes [plan.total_bytes] uint8
        .view(name)            my region as ``[shape] dtype``
        .peer_view(peer, name) the same region in a peer's buffer (symmetric kinds only)

Kinds (chosen by ``moe_ref.ep.transport``):

| kind      | memory                                                  | peers mappable |
|-----------|---------------------------------------------------------|----------------|
| private   | ``torch.zeros`` on the device (one process, or a2a)     | no (self only) |
| shm       | one file per rank in ``MOE_REF_SHM_DIR`` (/dev/shm), mapped by every rank of one host | yes |
| cuda      | ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``), peers over NVLink | yes |

Creation is collective: every rank checks that all ranks built the same cap and plan bytes, and raises
``CapacityMismatchError`` (CAP002) listing each rank's value otherwise (on every rank, so none hangs).

Shared-memory lifetime: names are agreed (``all_gather_object``) BEFORE any file exists; each rank creates
its file, maps every peer's, and once every rank has mapped every file (a collective), each rank unlinks
its own file at once. From then on the memory lives only as long as the mappings, so nothing is left in
/dev/shm when a rank exits, raises or is killed. If setup fails part-way (a peer died, a file is missing),
every surviving rank unlinks every agreed name it can. Should all survivors die in that window too (a
few milliseconds), the file's name carries its creator's pid, and the next shared-memory buffer on the
host removes files of dead creators (``sweep_stale_shm_files``).
"""
from __future__ import annotations

import os
import socket
import tempfile
import uuid
import weakref

import torch
import torch.distributed as dist

from moe_ref.core import envs
from moe_ref.ep.capacity import CapacityPlan, format_bytes
from moe_ref.ep.distributed import comm_device, gather_ints, group_size_and_rank
from moe_ref.kernels.ep.ep_regions import PeerBuffers
from moe_ref.core.errors import (BufferTooSmallError, CapacityMismatchError, DistributedError, GroupDisagreementError,
                                 MemoryBudgetError, ShmDirectoryError, UnknownNameError)

BUFFER_KINDS = ("private", "shm", "cuda")
CUDA_BARRIER_TIMEOUT_MS = 30_000  # the longest a rank waits for its peers at a CUDA symmetric-memory barrier


def _unlink_quietly(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except (FileNotFoundError, PermissionError, OSError):
            pass


SHM_PREFIX = "moe_ref_"


def shm_file_name(folder: str, rank: int) -> str:
    """``{folder}/moe_ref_{random}_{pid}_r{rank}``: unique, and names the creating process."""
    return os.path.join(folder, f"{SHM_PREFIX}{uuid.uuid4().hex[:12]}_{os.getpid()}_r{rank}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def sweep_stale_shm_files(folder: str | None = None) -> list[str]:
    """Remove buffer files in ``folder`` (default ``MOE_REF_SHM_DIR``) whose creating process is gone.

    Returns the removed paths. Files of live processes are left alone (they are unlinked by their owners
    right after setup anyway).
    """
    folder = folder or envs.shm_dir()
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        parts = name.split("_")
        if not name.startswith(SHM_PREFIX) or len(parts) != 5 or not parts[3].isdigit():
            continue
        if not _pid_alive(int(parts[3])):
            _unlink_quietly(os.path.join(folder, name))
            removed.append(os.path.join(folder, name))
    return removed


def _filesystem_type(folder: str) -> str | None:
    """The type of the filesystem ``folder`` lies on (``tmpfs``, ``proc``, ``ext4``, ...), from the longest mount
    point above it in ``/proc/self/mounts``; None where that cannot be read."""
    path = os.path.realpath(folder)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")  # the mounts file escapes spaces
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def shm_dir_problem(folder: str) -> str | None:
    """Why ``folder`` (``MOE_REF_SHM_DIR``) cannot hold a shared-memory buffer file at all, or None: it is no
    directory, no file can be created in it, or it has no free space (a tight but non-zero space is the
    cap's problem, CAP004). The filesystem type is named when it is not tmpfs."""
    if not os.path.isdir(folder):
        return f"MOE_REF_SHM_DIR={folder!r} {'is not a directory' if os.path.exists(folder) else 'does not exist'}"
    kind = _filesystem_type(folder)
    what = f"MOE_REF_SHM_DIR={folder!r}" + (f" (filesystem {kind}, not tmpfs)" if kind not in (None, "tmpfs") else "")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"{what}: no file can be created there ({err.strerror or err})"
    stat = os.statvfs(folder)
    if stat.f_bavail * stat.f_frsize == 0:
        return f"{what} has no free space"
    return None


class SymmetricBuffer:
    """One rank's buffer, laid out by ``plan``; owns the memory and the peer views, released by ``destroy``.

    Args:
        plan: the layout (identical on every rank; checked collectively).
        group: the EP process group, or None for one process.
        kind: ``"private"``, ``"shm"`` or ``"cuda"`` (see the module docstring).
        device: the device of the memory (``cpu`` for private/shm; a CUDA device for cuda).

    Attributes:
        plan, group, kind, device, rank, world_size.
        nbytes: bytes allocated for this rank, equal to ``plan.total_bytes``.

    Raises:
        CapacityMismatchError (CAP002): ranks built different caps or plans (raised on every rank).
        ShmDirectoryError (CAP005): kind ``shm`` and ``MOE_REF_SHM_DIR`` cannot hold a file (every rank).
        MemoryBudgetError (CAP004): a rank's memory (or shm folder) has less room than the plan (every rank).
        DistributedError (ENV003): the peers' memory cannot be mapped (raised on every rank).
    """

    def __init__(self, plan: CapacityPlan, group=None, *, kind: str = "private", device: torch.device | str = "cpu"):
        if kind not in BUFFER_KINDS:
            raise UnknownNameError(f"buffer kind={kind!r}; supported: {', '.join(BUFFER_KINDS)}")
        self.plan, self.group, self.kind, self.device = plan, group, kind, torch.device(device)
        self.world_size, self.rank = group_size_and_rank(group)
        self._paths: list[str] = []
        self._local_shm: torch.Tensor | None = None
        self._symm_handle = None
        self._peer_bytes: list[torch.Tensor | None] = []
        self._check_same_plan_everywhere()
        if kind == "shm":
            self._local_bytes = self._map_shared_files()
        elif kind == "cuda":
            self._local_bytes = self._rendezvous_cuda()
        else:
            self._local_bytes = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=self.device)
            self._peer_bytes = [self._local_bytes if peer == self.rank else None for peer in range(self.world_size)]
        if self._local_bytes.numel() < plan.total_bytes:
            raise BufferTooSmallError(f"allocated {self._local_bytes.numel()} bytes < plan {plan.total_bytes} bytes")
        self._views = {region.name: self._region_view(self._local_bytes, region.name) for region in plan.regions}
        # belt and braces: my own file is normally unlinked right after setup
        self._finalizer = weakref.finalize(self, _unlink_quietly, *self._paths[self.rank:self.rank + 1])

    # --- construction helpers ------------------------------------------------------------------------
    @staticmethod
    def size_hint(cfg, ep_size: int, num_max_tokens_per_rank: int, activation_dtype: torch.dtype = torch.bfloat16,
                  dispatch_fp8: bool = False, alignment: int = 128) -> int:
        """Bytes one rank's buffer will take (no allocation): ``CapacityPlan.build(...).total_bytes``."""
        return CapacityPlan.build(cfg, ep_size, num_max_tokens_per_rank, activation_dtype, dispatch_fp8,
                                  alignment).total_bytes

    def _check_same_plan_everywhere(self) -> None:
        """Collective: every rank has the same cap and plan bytes, and its memory can hold them (else a coded
        error on every rank, before anything is allocated)."""
        folder_problem = shm_dir_problem(envs.shm_dir()) if self.kind == "shm" else None
        free = self._free_bytes() if folder_problem is None else 0
        mine = [self.plan.num_max_tokens_per_rank, self.plan.total_bytes, free, int(folder_problem is not None)]
        if self.world_size == 1:
            gathered = [mine]
        else:
            mine_t = torch.tensor(mine, dtype=torch.int64, device=comm_device(self.group, self.device))
            parts = [torch.empty_like(mine_t) for _ in range(self.world_size)]
            dist.all_gather(parts, mine_t, group=self.group)
            gathered = [t.tolist() for t in parts]
        caps = [g[0] for g in gathered]
        plan_bytes = [g[1] for g in gathered]
        if len(set(caps)) > 1:
            per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(caps))
            raise CapacityMismatchError(
                f"num_max_tokens_per_rank differs across the EP group ({per_rank}); this is rank {self.rank} with "
                f"{caps[self.rank]}. Pass the same value on every rank (or set MOE_REF_NUM_MAX_TOKENS_PER_RANK in "
                f"the launcher for all ranks), e.g. {max(caps)}", caps=caps)
        if len(set(plan_bytes)) > 1:
            per_rank = ", ".join(f"rank {r}: {b}" for r, b in enumerate(plan_bytes))
            raise CapacityMismatchError(
                f"the buffer plans differ across the EP group although the caps agree ({caps[0]}): plan bytes "
                f"{per_rank}; every rank must use the same config, dtype, FP8 setting and alignment",
                plan_bytes=plan_bytes)
        need = self.plan.total_bytes
        bad_folders = [r for r, g in enumerate(gathered) if g[3]]
        if bad_folders:
            ranks = "this rank" if bad_folders == [self.rank] else f"rank(s) {bad_folders}"
            raise ShmDirectoryError(
                f"the shared-memory buffer ({need} bytes, {format_bytes(need)}, per rank) cannot be created: "
                f"{folder_problem or 'its folder fails there'} ({ranks}); point MOE_REF_SHM_DIR at a writable tmpfs "
                f"folder with at least {format_bytes(need)} free (unset: /dev/shm), or use transport='a2a'",
                folder=envs.shm_dir(), ranks=bad_folders, needed_bytes=need)
        short = [(r, g[2]) for r, g in enumerate(gathered) if 0 <= g[2] < g[1]]
        if short:
            folder = f" in {envs.shm_dir()} (MOE_REF_SHM_DIR)" if self.kind == "shm" else ""
            where = ", ".join(f"rank {r} has {format_bytes(f)} free{folder}" for r, f in short)
            budget = min(f for _, f in short)
            plan = self.plan
            if plan.alignment > 1 and plan.with_cap(1).total_bytes > budget and \
                    CapacityPlan.build(plan.cfg, plan.ep_size, caps[0], plan.activation_dtype, plan.dispatch_fp8, 1,
                                       plan.pool_format).total_bytes <= budget:
                raise MemoryBudgetError(
                    f"the {self.kind} buffer for num_max_tokens_per_rank={caps[0]} needs {need} bytes "
                    f"({format_bytes(need)}) per rank, but {where}: alignment={plan.alignment} pads every expert "
                    f"segment of the receive pool to a multiple of {plan.alignment} rows, so even a cap of 1 does "
                    f"not fit (with alignment=1 the buffer fits). Lower alignment (None: the experts backend's own, "
                    f"e.g. 128 for torch, 1 for triton)", needed_bytes=need, budget_bytes=budget, field="alignment")
            raise MemoryBudgetError(
                f"the {self.kind} buffer for num_max_tokens_per_rank={caps[0]} needs {need} bytes "
                f"({format_bytes(need)}) per rank, but {where}; lower the cap (`moe-ref plan --budget-gib G` prints "
                f"the largest that fits) or use more EP ranks"
                f"{', or point MOE_REF_SHM_DIR at a larger tmpfs' if self.kind == 'shm' else ''}",
                needed_bytes=need, budget_bytes=min(f for _, f in short))

    def _free_bytes(self) -> int:
        """Bytes this rank could allocate for its buffer, or -1 when unknown."""
        try:
            if self.kind == "shm":
                stat = os.statvfs(envs.shm_dir())
                return stat.f_bavail * stat.f_frsize
            if self.device.type == "cuda":
                return int(torch.cuda.mem_get_info(self.device)[0])
            with open("/proc/meminfo") as meminfo:  # MemAvailable counts reclaimable page cache, unlike free pages
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, RuntimeError, AttributeError):
            pass
        return -1

    def _map_shared_files(self) -> torch.Tensor:
        """Create my file, map every peer's, then unlink mine (see the module docstring)."""
        if self.device.type != "cpu":
            raise DistributedError(f"the shared-memory buffer lives on the CPU, not {self.device}")
        folder = envs.shm_dir()
        sweep_stale_shm_files(folder)
        mine = shm_file_name(folder, self.rank)
        hosts_paths: list = [None] * self.world_size
        dist.all_gather_object(hosts_paths, (socket.gethostname(), mine), group=self.group)
        self._paths = [path for _, path in hosts_paths]
        hosts = sorted({host for host, _ in hosts_paths})
        if len(hosts) > 1:  # every rank sees the same gathered list, so every rank raises
            raise DistributedError(f"the shared-memory buffer needs all ranks on one host; the EP group spans "
                                   f"{hosts}; use transport='a2a' across hosts")
        nbytes = self.plan.total_bytes
        try:
            problem = self._create_file(mine, nbytes)
            self._agree(problem, "create")
            peers: list[torch.Tensor | None] = []
            problem = None
            for peer, path in enumerate(self._paths):
                if peer == self.rank:
                    peers.append(None)
                    continue
                try:
                    if os.stat(path).st_size != nbytes:  # never let from_file create or grow a file
                        raise OSError(f"{path} has {os.stat(path).st_size} bytes, expected {nbytes}")
                    peers.append(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
                except OSError as err:
                    problem = problem or f"rank {self.rank} cannot map rank {peer}'s {path}: {err}"
                    peers.append(None)
            self._agree(problem, "map")  # after this, every rank has mapped every file
        except BaseException:
            _unlink_quietly(*self._paths)
            raise
        _unlink_quietly(mine)
        peers[self.rank] = self._local_shm
        self._peer_bytes = peers
        return self._local_shm

    def _create_file(self, path: str, nbytes: int) -> str | None:
        """Create and map ``path`` (exclusively); returns a problem description or None."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            self._local_shm = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            return None
        except OSError as err:
            return f"rank {self.rank} cannot create {path} ({nbytes} bytes): {err}"

    def _agree(self, problem: str | None, step: str) -> None:
        """Collective: raise ``DistributedError`` on every rank if any rank reports a problem."""
        device = comm_device(self.group, self.device)
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag) or problem is not None:
            where = (f"all ranks on one host with a shared {envs.shm_dir()} (MOE_REF_SHM_DIR)" if self.kind == "shm"
                     else "GPUs that can map each other's memory (P2P/NVLink)")
            raise DistributedError(
                f"{self.kind} buffer: step '{step}' failed ({problem or 'on another rank'}); the symm transport "
                f"needs {where}; use transport='a2a' otherwise")

    def _rendezvous_cuda(self) -> torch.Tensor:
        """``symm_mem.empty`` + ``rendezvous``; peers through ``handle.get_buffer``."""
        import torch.distributed._symmetric_memory as symm_mem

        if self.device.type != "cuda":
            raise DistributedError(f"CUDA symmetric memory needs a CUDA device, not {self.device}")
        nbytes = self.plan.total_bytes
        group = self.group if self.group is not None else dist.group.WORLD
        problem = None
        try:
            local = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
            local.zero_()
            self._symm_handle = symm_mem.rendezvous(local, group.group_name)
        except RuntimeError as err:  # e.g. no P2P between the GPUs; every rank learns it and raises alike
            problem = f"rank {self.rank}: CUDA symmetric memory rendezvous failed: {err}"
        self._agree(problem, "rendezvous")
        self._peer_bytes = [local if peer == self.rank else self._symm_handle.get_buffer(peer, (nbytes,), torch.uint8)
                            for peer in range(self.world_size)]
        self._symm_handle.barrier(channel=0)  # every rank's memory is zeroed before any peer touches it
        return local

    # --- views -------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated for this rank (== ``plan.total_bytes``)."""
        self._check_alive()
        return self._local_bytes.numel()

    @property
    def is_symmetric(self) -> bool:
        """True when every peer's memory is mapped here (shm, cuda, or a single rank)."""
        return self.kind in ("shm", "cuda") or self.world_size == 1

    def _region_view(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        region = self.plan.region(name)
        return raw[region.offset:region.end].view(region.dtype).view(region.shape)

    def view(self, name: str) -> torch.Tensor:
        """My region ``name`` as a ``[shape] dtype`` tensor (a view into the buffer)."""
        self._check_alive()
        return self._views[name]

    def peer_view(self, peer: int, name: str) -> torch.Tensor:
        """Region ``name`` of rank ``peer``'s buffer (reads and writes go to the peer's memory)."""
        self._check_alive()
        if peer == self.rank:
            return self._views[name]
        raw = self._peer_bytes[peer] if 0 <= peer < len(self._peer_bytes) else None
        if raw is None:
            raise DistributedError(f"rank {peer}'s buffer is not mapped here (kind={self.kind!r}); only symmetric "
                                   f"kinds (shm, cuda) map peers")
        return self._region_view(raw, name)

    def view_bytes(self) -> torch.Tensor:
        """My whole buffer, ``[nbytes]`` uint8 (what ``EPRegions.view`` slices)."""
        self._check_alive()
        return self._local_bytes

    def peer_buffers(self) -> PeerBuffers:
        """Every rank's bytes as mapped here, with their base addresses (what the device-side kernels and their
        twins take; ``kernels.ep_regions.PeerBuffers``). Symmetric kinds only."""
        self._check_alive()
        if not self.is_symmetric:
            raise DistributedError(f"peers' buffers are not mapped here (kind={self.kind!r}); only symmetric kinds "
                                   f"(shm, cuda) map peers")
        return PeerBuffers.from_tensors(self.rank, self._peer_bytes)

    def barrier(self) -> None:
        """Order my writes before my peers' reads: ``dist.barrier`` (shm), ``handle.barrier`` (cuda)."""
        self._check_alive()
        if self.world_size == 1:
            return
        if self.kind == "cuda":
            # NOTE: bounded: a peer that never arrives makes torch's barrier kernel fail after the timeout (a CUDA
            # error the routed step reports as PeerFailedError, ENV005) instead of spinning forever.
            self._symm_handle.barrier(channel=0, timeout_ms=CUDA_BARRIER_TIMEOUT_MS)
        else:
            dist.barrier(group=self.group)

    # --- teardown ------------------------------------------------------------------------------------------
    @property
    def destroyed(self) -> bool:
        return self._local_bytes is None

    def _check_alive(self) -> None:
        if self._local_bytes is None:
            raise RuntimeError("this SymmetricBuffer was destroyed; build a new one")

    def destroy(self) -> None:
        """Release the memory and the peer mappings now (idempotent; not collective)."""
        self._views = {}
        self._peer_bytes = []
        self._local_bytes = None
        self._local_shm = None
        self._symm_handle = None
        self._finalizer()

    def __enter__(self) -> "SymmetricBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


# --- one buffer per EP group, shared by every layer with the same plan -------------------------------------------

# NOTE: process-wide state: (group, kind, device, plan layout) -> [buffer, users]. Layers of one model run one at a
# time and nothing in the buffer outlives a call, so they can share it (Kimi-K2 at EP 8, cap 4096: ~4 GiB per rank
# instead of ~4 GiB per rank per layer).
_SHARED: dict[tuple, list] = {}


def _buffer_key(plan: CapacityPlan, group, kind: str, device: torch.device) -> tuple:
    group_key = None if group is None else getattr(group, "group_name", None) or id(group)
    layout = tuple((r.name, r.offset, r.shape, str(r.dtype)) for r in plan.regions)
    return group_key, kind, str(device), plan.total_bytes, layout


def acquire_buffer(plan: CapacityPlan, group=None, *, kind: str = "private",
                   device: torch.device | str = "cpu") -> SymmetricBuffer:
    """The group's shared buffer for ``plan`` (allocated on first use; collective over ``group``).

    Every rank must agree whether it already holds one: a rank that destroyed its layers while the others did not
    would skip the allocation its peers enter, so a mixed answer raises ``GroupDisagreementError`` (CFG008) on
    every rank. Pair each call with ``release_buffer``.
    """
    device = torch.device(device)
    key = _buffer_key(plan, group, kind, device)
    entry = _SHARED.get(key)
    world, rank = group_size_and_rank(group)
    if world > 1:
        held = [row[0] for row in gather_ints([int(entry is not None and not entry[0].destroyed)], group,
                                              comm_device(group, device))]
        if len(set(held)) > 1:
            raise GroupDisagreementError(
                f"rank {rank}: the ranks disagree whether this EP group's shared {kind} buffer exists (held on ranks "
                f"{[r for r, h in enumerate(held) if h]}, not on {[r for r, h in enumerate(held) if not h]}): layers "
                f"were destroyed on some ranks only; build and destroy MoE layers on every rank alike", held=held)
    if entry is None or entry[0].destroyed:
        entry = _SHARED[key] = [SymmetricBuffer(plan, group, kind=kind, device=device), 0]
    entry[1] += 1
    return entry[0]


def release_buffer(buffer: SymmetricBuffer) -> None:
    """One user fewer; the last one frees the buffer (not collective)."""
    for key, entry in list(_SHARED.items()):
        if entry[0] is buffer:
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _SHARED[key]
            break
    buffer.destroy()


def live_shared_buffers() -> int:
    """How many shared buffers this process holds (for tests and ``moe-ref`` reports)."""
    return sum(1 for buffer, _ in _SHARED.values() if not buffer.destroyed)

