"""Data parallelism over prompts on ``torch.distributed`` (calibration and benchmarks).

Any launcher that sets the usual environment (``torchrun --nproc-per-node N``, SLURM wrappers, ...) works:
``RANK``, ``WORLD_SIZE`` (and ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) are read, the default process
group is initialised with ``gloo`` on CPU or ``nccl`` on CUDA, prompts are sharded by rank deterministically
(prompt ``k`` goes to rank ``k % world_size``), every rank works on its own prompts, and the per-prompt results are
gathered in prompt order, so what is computed from them does not depend on the number of processes.

Without a launcher (no ``WORLD_SIZE``, or ``WORLD_SIZE=1``) nothing is initialised and every helper degrades to
the single-process case: :func:`shard` keeps every index and :func:`gather_in_order` just sorts.

Typical use::

    with data_parallel(device) as dp:
        mine = [(k, work(prompts[k])) for k in dp.shard(len(prompts))]
        results = dp.gather_in_order(mine, len(prompts))   # every rank gets the full, ordered list
        if dp.is_main:
            write(results)
"""

from __future__ import annotations

import atexit
import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from spiffy.errors import ConfigError

T = TypeVar("T")

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnvironment:
    """What the launcher told this process.

    Attributes:
        rank: global rank (0-based); world_size: number of processes; local_rank: rank on this node (selects the
        GPU); master_addr / master_port: the rendezvous address (``None`` when the launcher does not set them).
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: str | None = None


def _int_env(environ: Mapping[str, str], key: str, default: int | None) -> int | None:
    text = environ.get(key)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {key}={text!r} is not an integer; fix: unset it or launch with "
                          "torchrun, which sets it") from None


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchEnvironment | None:
    """The launcher environment, or ``None`` for a plain single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``).

    Raises:
        ConfigError: inconsistent variables (a rank outside ``[0, WORLD_SIZE)``, a missing ``RANK``, non-integers).
    """
    env = os.environ if environ is None else environ
    world = _int_env(env, "WORLD_SIZE", None)
    if world is None or world == 1:
        return None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1; fix: launch with torchrun --nproc-per-node N")
    rank = _int_env(env, "RANK", None)
    if rank is None:
        raise ConfigError("WORLD_SIZE is set but RANK is not; fix: launch with torchrun (it sets both)")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world}); fix: launch with torchrun")
    local = _int_env(env, "LOCAL_RANK", rank)
    assert local is not None
    return LaunchEnvironment(rank, world, local, env.get("MASTER_ADDR"), env.get("MASTER_PORT"))


def shard_indices(total: int, rank: int, world_size: int) -> list[int]:
    """Indices ``k`` in ``range(total)`` owned by ``rank``: ``k % world_size == rank`` (round robin, so datasets
    sorted by length still spread their long prompts over the ranks)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} / world size {world_size} is not a valid shard")
    return list(range(rank, max(0, int(total)), world_size))


def merge_in_order(parts: Sequence[Sequence[tuple[int, T]]], total: int) -> list[T]:
    """Merge per-rank ``[(index, item), ...]`` lists into ``[item for index 0..]`` (indices absent are left out).

    Raises:
        ConfigError: an index outside ``[0, total)`` or reported twice (a sharding bug, never silently merged).
    """
    by_index: dict[int, T] = {}
    for part in parts:
        for index, item in part:
            if not 0 <= int(index) < total or int(index) in by_index:
                raise ConfigError(f"result index {index} is out of range or duplicated (total {total})")
            by_index[int(index)] = item
    return [by_index[k] for k in sorted(by_index)]


def device_for_rank(device: str | torch.device | None, launch: LaunchEnvironment | None) -> torch.device:
    """The device this process should use: ``device`` as given, except that a bare ``"cuda"`` under a launcher
    becomes ``cuda:LOCAL_RANK`` (one GPU per process). ``None`` picks CUDA when available, else CPU."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if launch is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", launch.local_rank)
    return dev


class DataParallel:
    """The process group of one data-parallel run (or the trivial one-process group).

    Attributes:
        launch: the launcher environment (``None`` in a single process); device: this process's device.
    """

    def __init__(self, launch: LaunchEnvironment | None, device: torch.device) -> None:
        self.launch = launch
        self.device = device

    @property
    def rank(self) -> int:
        return 0 if self.launch is None else self.launch.rank

    @property
    def world_size(self) -> int:
        return 1 if self.launch is None else self.launch.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints and writes files."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    def shard(self, total: int) -> list[int]:
        """The prompt indices this rank works on (see :func:`shard_indices`)."""
        return shard_indices(total, self.rank, self.world_size)

    def gather_in_order(self, local: Sequence[tuple[int, T]], total: int) -> list[T]:
        """Every rank's ``[(index, item), ...]`` merged in index order, returned on every rank.

        Items must be picklable (they travel through :func:`torch.distributed.all_gather_object`). With one
        process this only sorts ``local``.
        """
        if not self.active:
            return merge_in_order([list(local)], total)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, list(local))
        return merge_in_order(parts, total)

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.active:
            dist.barrier()


def _init_process_group(launch: LaunchEnvironment, device: torch.device) -> bool:
    """Initialise the default group for ``launch`` unless one exists; True when this call created it."""
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; fix: run a single process (no torchrun)")
    if dist.is_initialized():
        if dist.get_world_size() != launch.world_size or dist.get_rank() != launch.rank:
            raise ConfigError(
                f"a process group of size {dist.get_world_size()} (rank {dist.get_rank()}) already exists, but the "
                f"environment says rank {launch.rank} of {launch.world_size}; fix: launch once, with one torchrun"
            )
        return False
    if launch.master_addr is None or launch.master_port is None:
        raise ConfigError(
            "WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT; fix: launch with torchrun, which sets them"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, init_method="env://", rank=launch.rank, world_size=launch.world_size)
    return True


@contextlib.contextmanager
def data_parallel(device: str | torch.device | None = None,
                  environ: Mapping[str, str] | None = None) -> Iterator[DataParallel]:
    """Join the data-parallel run the launcher started (or run alone), yield it, tear the group down after.

    Args:
        device: the requested device (``None``: CUDA when available, else CPU; a bare ``"cuda"`` becomes
            ``cuda:LOCAL_RANK`` under a launcher); the backend follows it: NCCL for CUDA, gloo otherwise.
        environ: the environment to read (default ``os.environ``).
    Yields:
        :class:`DataParallel` with this process's rank, world size and device.
    """
    launch = detect_launch(environ)
    dev = device_for_rank(device, launch)
    created = _init_process_group(launch, dev) if launch is not None else False
    try:
        yield DataParallel(launch, dev)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def join_data_parallel(device: str | torch.device | None = None,
                       environ: Mapping[str, str] | None = None) -> DataParallel:
    """Like :func:`data_parallel` for a command's whole life: the group it creates is torn down at exit."""
    launch = detect_launch(environ)
    dev = device_for_rank(device, launch)
    if launch is not None and _init_process_group(launch, dev):
        atexit.register(_destroy_group)
    return DataParallel(launch, dev)


def _destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "ENV_KEYS",
    "DataParallel",
    "LaunchEnvironment",
    "data_parallel",
    "detect_launch",
    "join_data_parallel",
    "device_for_rank",
    "merge_in_order",
    "shard_indices",
]
