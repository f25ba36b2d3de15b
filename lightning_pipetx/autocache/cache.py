"""AutoCache: the frozen prefix's output per training sample, in the fastest memory that holds it.

The output of blocks ``[0, F)`` for a sample depends only on the sample once those blocks
are frozen (eval mode, no gradient), so it is computed once and read back afterwards.
Entries are keyed by (sample index, depth ``F``). Each depth keeps its states in tiers
(:mod:`.tiers`): the training device up to a budget, then a file every process of the node
maps, in ``/dev/shm`` up to the budget and half the mount's free space, else on disk. States are
stored in the dtype the block returned, so a hit is exact. When the depth grows from ``F1``
to ``F2``, a sample cached at ``F1`` runs blocks ``[F1, F2)`` only, and older depths' files go.

On a GPU, host reads are gathered into pinned memory and copied on a side stream one step
ahead (:meth:`AutoCache.prefetch`), and writes to host tiers go back asynchronously. Reading
and computing are timed (CUDA events, read once per epoch): a tier whose read costs more than
computing the prefix is dropped with one log line.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipetx.autocache.entries import Depth, EpochCounts, Prefetched
from lightning_pipetx.autocache.guards import CHANGED_INPUT, CHANGED_PREFIX_INPUT, SERVED_STALE, InputGuard
from lightning_pipetx.autocache.states import EXTRA_OUTPUTS, EXTRA_OUTPUTS_FIX, LAYOUT_FIX, STILL_TRAINS, RowLayout
from lightning_pipetx.autocache.stopwatch import Stopwatch
from lightning_pipetx.autocache.tiers import (
    TIER_NAMES,
    DeviceTier,
    FileTier,
    SharedFileMismatchError,
    Tier,
    free_bytes,
    nbytes_of,
    ram_room,
)
from lightning_pipetx.strategy.microbatch import sample_shapes
from lightning_pipetx.strategy.p2p import Activation

log = logging.getLogger("lightning_pipetx")

DEVICE_SHARE = 1 / 3  # of the GPU's free memory, for cache_device_bytes="auto"


class AutoCache:
    """Per-sample hidden states at each frozen depth, for one run on one node."""

    def __init__(
        self,
        directory: Path,
        spill_directory: Path,
        num_samples: int,
        ram_budget: int,
        device: torch.device | None = None,
        device_budget: int | str = "auto",
        share_host: bool = True,
        label: str = "AutoCache",
    ) -> None:
        self.label = label  # how log lines name this cache
        self.directory, self.spill_directory = directory, spill_directory
        self.num_samples = num_samples
        self.ram_budget = ram_budget
        self.device = device = device or torch.device("cpu")
        self.device_budget = device_budget
        self.share_host = share_host  # other first-stage ranks of the node read the host tier too
        self.budget_sharers: list[AutoCache] = []  # other caches of this process drawing on the same budgets
        self.guard = InputGuard(num_samples, device)  # the loaded batches
        self.prefix_guard = InputGuard(num_samples, device, tolerance=1e-4)  # what enters the frozen blocks
        self.force = False  # cache=True: a changed input only warns
        self.strict = False  # serve only once what enters the frozen blocks was also compared unchanged
        self._reloaded = False  # the loader's hook ran again: strict from then on (its inputs may not be tensors)
        self.enabled = True
        self.input_shapes: list[tuple[int, ...]] | None = None  # of one sample, per tensor of the first batch
        self.prefix_input_shape: tuple[int, ...] | None = None  # of one sample's hidden state entering block 0
        self.fills = True  # caches the samples drop_last leaves out (off once the user's step failed on them)
        self.dropped: set[str] = set()  # tiers measured slower than computing the prefix
        self.counts = EpochCounts()
        self.watch = Stopwatch(device)
        self._depths: dict[int, Depth] = {}
        self._writes: list[tuple[Tier, torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self._prefetched: Prefetched | None = None
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._warned = False
        self.layout = RowLayout()  # whether the hidden states' dimension 0 is the batch
        self.extras_unread: bool | None = None  # whether nothing reads the prefix output's other elements

    # ------------------------------------------------------------------ guards
    @property
    def paying(self) -> bool:
        """Enabled, with a tier still worth reading (reading it was not measured slower than computing)."""
        has_device = (
            self.device_budget == "auto" and self.device.type == "cuda" or self.device_budget not in (0, "auto")
        )
        return self.enabled and ((has_device and "device" not in self.dropped) or "host" not in self.dropped)

    @property
    def serving(self) -> bool:
        """Hits may be served: paying, and the inputs (strict, or rows not yet shown to be samples: and the
        frozen blocks' input) passed a check."""
        strict = self.strict or self.layout.unproven or self._reloaded
        return self.paying and self.guard.trusted and (self.prefix_guard.trusted or not strict)

    def reloaded(self) -> None:
        """The loader's hook built it again (``reload_dataloaders_every_n_epochs``) over the same
        dataset, which may have changed its samples in place: nothing is served until both guards
        compared samples loaded since, unchanged."""
        self._reloaded = True
        self._prefetched = None
        self.guard.distrust()
        self.prefix_guard.distrust()

    def disable(self, reason: str, warn: bool = True) -> None:
        self.enabled = False
        self._prefetched = None
        if warn and not self._warned:
            self._warned = True
            log.warning("pipetx: %s switched off for this run: %s", self.label, reason)

    def check_input_shapes(self, batch: Any) -> None:
        """Switch the cache off at a batch whose samples are shaped otherwise than the run's first
        batch's (padded to another length: dynamic padding), before a state cached for another
        length is served to them."""
        shapes = sample_shapes(batch)
        if self.input_shapes is None:
            self.input_shapes = shapes
        elif shapes != self.input_shapes:
            self.disable(
                f"a batch's samples have shapes {shapes}, the run's first batch's {self.input_shapes}: "
                f"dynamic padding, which pads a sample to another length in another batch. Pad every batch to one "
                f"length to use the cache, or pass cache=False."
            )

    def refuse(self, reason: str, fix: str) -> None:
        """An error under ``cache=True``, else off with a warning."""
        if self.force:
            raise ValueError(f"ElasticPipelineStrategy(cache=True): {reason}. {fix}.")
        self.disable(f"{reason}. {fix}.")

    def _changed(self, reason: str) -> None:
        if not self.force:
            self.disable(reason)
        elif not self._warned:
            self._warned = True
            log.warning(
                "pipetx: %s: an input changed between epochs; cache=True keeps caching it (%s)", self.label, reason
            )

    def begin_epoch(self, group_size: int) -> None:
        """Agree over every rank on what the last epoch showed (collective): a changed input
        switches the cache off; a tier slower than computing the prefix is dropped."""
        self.flush_writes()
        self._adopt_shared_depths()
        slow = self.watch.slower_than_compute(max(self._depths, default=0))
        counts = self.guard.take_counts().cpu()
        flags = torch.cat(
            [
                counts,
                self.prefix_guard.take_counts().cpu(),
                torch.tensor([float(not self.enabled), *self.layout.flags()] + [float(n in slow) for n in TIER_NAMES]),
            ]
        ).to(self.device, torch.float64)
        if group_size > 1:
            dist.all_reduce(flags)
            self._agree_prefix_input_shape(group_size)
        values, n = flags.tolist(), len(counts)
        inputs, prefix_inputs, (disabled, *layout_flags) = values[:n], values[n : 2 * n], values[2 * n :]
        self.layout.agree(layout_flags[:2])
        slow_flags = layout_flags[2:]
        served = self.guard.trusted  # since the last verdict: an input changed since then may have been served stale
        input_changed = self.guard.judge(*inputs)
        prefix_input_changed = self.prefix_guard.judge(*prefix_inputs)  # both judged: each ends its checkpoint's use
        if input_changed:
            self._changed(CHANGED_INPUT + (SERVED_STALE if served else ""))
        elif prefix_input_changed:
            if not self.layout.unproven:
                self._changed(CHANGED_PREFIX_INPUT + ("" if self.strict else SERVED_STALE))  # strict: never served
            elif not disabled:  # its rows may be no samples (never served); on every rank alike
                self.refuse(self.layout.suspect(), LAYOUT_FIX)
        if disabled and self.enabled:
            self.disable("another rank switched it off")
        if not self.enabled:  # every rank alike: nobody reads the states again
            self._release()
        for name, flag in zip(TIER_NAMES, slow_flags):
            if flag and name not in self.dropped:
                # Disk is never faster than host RAM: dropping RAM drops disk too.
                self.dropped.update(TIER_NAMES[TIER_NAMES.index(name) :] if name == "host" else (name,))
                self._prefetched = None
                log.info("pipetx: %s stops using its %s tier: %s", self.label, name, self.watch.explain(name))

    def _agree_prefix_input_shape(self, group_size: int) -> None:
        """Every rank takes the block-0 input shape a first stage saw (collective): a rank that is
        a first stage only after a transition compares with it too."""
        shapes: list[tuple[int, ...] | None] = [None] * group_size
        dist.all_gather_object(shapes, self.prefix_input_shape)
        if self.prefix_input_shape is None:
            self.prefix_input_shape = next((shape for shape in shapes if shape is not None), None)

    # ------------------------------------------------------------- entries
    def _level(self, indices: torch.Tensor, depth: int) -> tuple[int, list[Tier], list[torch.Tensor]]:
        """The deepest depth ``<= depth`` at which some tier holds every sample."""
        for level in sorted(self._depths, reverse=True):
            if level > depth:
                continue
            tiers = [t for t in self._depths[level].tiers if t.name not in self.dropped]
            masks = [t.holds(indices) for t in tiers]
            if masks and torch.stack(masks).any(0).all():
                return level, tiers, masks
        return 0, [], []

    def _gather(
        self, level: int, indices: torch.Tensor, tiers: list[Tier], masks: list[torch.Tensor], stream=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of ``indices`` at ``level``, each from the first tier that holds it, and
        which tier that was (a host tensor of indices into ``TIER_NAMES``)."""
        entry = self._depths[level]
        source = torch.full((len(indices),), -1, dtype=torch.int8)
        out = None
        for tier, mask in zip(tiers, masks):
            take = mask & (source < 0)
            count = int(take.sum())
            if count == 0:
                continue
            source[take] = TIER_NAMES.index(tier.name)
            if count == len(indices):
                with self.watch.reading(tier.name, count, stream):
                    return tier.read(indices, self.device), source
            rows = tier.read(indices[take], self.device)
            if out is None:
                out = torch.empty((len(indices), *entry.shape), dtype=entry.dtype, device=self.device)
            out.index_copy_(0, take.nonzero().flatten().to(self.device, non_blocking=True), rows)
        return out, source

    def cached_depth(self, indices: torch.Tensor, depth: int) -> int:
        """The deepest depth ``<= depth`` at which every sample is cached (0: none)."""
        return self._level(indices, depth)[0]

    def lookup(
        self, indices: torch.Tensor, depth: int, counts: EpochCounts | None = None
    ) -> tuple[int, torch.Tensor | None, int]:
        """The deepest depth ``<= depth`` at which every sample is cached: (depth, states, tuple_len),
        counted in ``counts`` (by default the epoch's hit rate and tiers served)."""
        counts = self.counts if counts is None else counts
        counts.lookups += len(indices)
        if not self.serving:
            return 0, None, 0
        states, level, source = self._take_prefetched(indices, depth)
        if states is None:
            level, tiers, masks = self._level(indices, depth)
            if level == 0:
                return 0, None, 0
            states, source = self._gather(level, indices, tiers, masks)
        else:
            counts.prefetched += len(indices)
        if level == depth:
            counts.hits += len(indices)
        row_bytes = nbytes_of(1, tuple(states.shape[1:]), states.dtype)
        for code, samples in enumerate(torch.bincount(source.long(), minlength=len(TIER_NAMES)).tolist()):
            counts.served[TIER_NAMES[code]] += samples
            counts.served_bytes[TIER_NAMES[code]] += samples * row_bytes
        return level, states, self._depths[level].tuple_len

    def prefetch(self, indices: torch.Tensor, depth: int) -> None:
        """Start reading the next batch's states (a side stream on a GPU) unless the device holds them."""
        self._prefetched = None
        if not self.serving:
            return
        level, tiers, masks = self._level(indices, depth)
        if level == 0 or (tiers[0].name == "device" and bool(masks[0].all())):
            return
        ready = None
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                states, source = self._gather(level, indices, tiers, masks, self._side)
                ready = torch.cuda.Event()
                ready.record(self._side)
        else:
            states, source = self._gather(level, indices, tiers, masks)
        position = torch.full((self.num_samples,), -1, dtype=torch.long)
        position[indices] = torch.arange(len(indices))
        self._prefetched = Prefetched(level, position, states, source, ready)

    def _take_prefetched(self, indices: torch.Tensor, depth: int):
        found = self._prefetched
        if found is None or found.level > depth or found.level not in self._depths:
            return None, 0, None
        position = found.position[indices]
        if not bool((position >= 0).all()):
            return None, 0, None
        if found.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(found.ready)
            found.states.record_stream(stream)
        states = found.states.index_select(0, position.to(self.device, non_blocking=True))
        return states, found.level, found.source[position]

    def store(self, indices: torch.Tensor, depth: int, output: Activation) -> None:
        if output.extra_tensors and not self.extras_unread:
            if self.extras_unread is None:  # the forward went on on a later stage: kept once one ends here
                return
            self.refuse(EXTRA_OUTPUTS, EXTRA_OUTPUTS_FIX)
            return
        if output.tensor.requires_grad:  # found mid-run, it switches the cache off whatever cache= says
            self.disable(STILL_TRAINS)
            return
        hidden, tuple_len = output.tensor, output.tuple_len
        if not self.layout.check(len(indices), tuple(hidden.shape)):
            self.refuse(*self.layout.wrong(len(indices), tuple(hidden.shape)))
            return
        shape = tuple(hidden.shape[1:])
        try:
            entry = self._depths.get(depth) or self._open(depth, shape, hidden.dtype, tuple_len)
        except SharedFileMismatchError as mismatch:
            self.disable(
                f"{mismatch}: dynamic padding, or first stages that differ. Pad every batch to one length to use "
                f"the cache, or pass cache=False."
            )
            return
        except OSError as error:  # neither the RAM folder nor the disk has room for the depth (or may be written)
            self.disable(
                f"no room for the states of depth {depth} ({nbytes_of(self.num_samples, shape, hidden.dtype) / 2**20:.1f}"
                f" MiB) in {self.spill_directory.parent} ({error.strerror or error}). Pass cache_dir= a folder with "
                f"room that this process may write, or cache=False"
            )
            return
        if entry.shape != shape:
            self.disable(
                f"hidden states of shape {shape} and {entry.shape} at one depth: dynamic padding. Pad every batch "
                f"to one length to use the cache, or pass cache=False."
            )
            return
        missing = torch.ones(len(indices), dtype=torch.bool)
        for tier in entry.tiers:
            if tier.name in self.dropped:
                continue
            if isinstance(tier, DeviceTier):
                tier.write(indices, hidden)
                missing = ~tier.holds(indices)
                continue
            keep = missing | self.share_host
            if bool(keep.any()):
                rows = hidden if bool(keep.all()) else hidden[keep.to(hidden.device)]
                self._write_back(tier, indices[keep], rows.detach())
            break

    def _write_back(self, tier: Tier, indices: torch.Tensor, rows: torch.Tensor) -> None:
        if self._side is None:
            tier.write(indices, rows)
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            pinned.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        rows.record_stream(self._side)
        self._writes.append((tier, indices, pinned, done))

    def flush_writes(self) -> None:
        """Finish the asynchronous writes to host tiers (their copies ended a step ago)."""
        for tier, indices, pinned, done in self._writes:
            done.synchronize()
            tier.write(indices, pinned)
        self._writes.clear()

    def _open(self, depth: int, shape: tuple[int, ...], dtype: torch.dtype, tuple_len: int) -> Depth:
        tiers: list[Tier] = []
        rows = self._device_rows(shape, dtype)
        if rows > 0:
            tiers.append(DeviceTier(self.num_samples, rows, shape, dtype, self.device))
        if rows < self.num_samples or self.share_host:
            file_tier = self._file_tier(depth, shape, dtype, tuple_len)
            if file_tier is not None:
                tiers.append(file_tier)
        self._depths[depth] = entry = Depth(tiers, tuple_len, shape, dtype)
        return entry

    def _adopt_shared_depths(self) -> None:
        """Open the depths another rank of the node keeps in a shared file: after a transition
        this rank may be a new first stage, which then reads the states the old ones cached."""
        for name, folder in (("host", self.directory), ("disk", self.spill_directory)):
            if name in self.dropped:
                continue
            for depth, tier, tuple_len in FileTier.described(name, folder, self.num_samples, skip=set(self._depths)):
                self._depths[depth] = Depth([tier], tuple_len, tuple(tier.data.shape[1:]), tier.data.dtype)

    def _device_rows(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        if "device" in self.dropped:
            return 0
        budget = self.device_budget
        if budget == "auto":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * DEVICE_SHARE) if self.device.type == "cuda" else 0
        budget -= self._budget_used("device")
        return max(0, min(self.num_samples, budget // max(1, nbytes_of(1, shape, dtype))))

    def _file_tier(self, depth: int, shape: tuple[int, ...], dtype: torch.dtype, tuple_len: int) -> FileTier | None:
        """The depth's file in RAM where the budget and the mount hold it, else on disk; None where
        reading either was measured slower than computing. OSError: the disk has no room either."""
        nbytes = nbytes_of(self.num_samples, shape, dtype)
        # Another rank of the node may have placed this depth in RAM already: share its file.
        room = ram_room(self.ram_budget, self._budget_used("host"), free_bytes(self.directory))
        fits = (self.directory / f"depth{depth}").exists() or nbytes <= room
        if fits and "host" not in self.dropped:
            try:
                return FileTier("host", self.directory, depth, self.num_samples, shape, dtype, tuple_len)
            except OSError as error:  # the RAM file system is full (or smaller than it said)
                log.info(
                    "pipetx: AutoCache: %s has no room for depth %d (%.1f MiB: %s); it goes to %s",
                    self.directory.parent,
                    depth,
                    nbytes / 2**20,
                    error.strerror,
                    self.spill_directory,
                )
        if "disk" in self.dropped:
            return None
        return FileTier("disk", self.spill_directory, depth, self.num_samples, shape, dtype, tuple_len)

    def drop_below(self, depth: int) -> None:
        """Free the depths below ``depth`` except the deepest of them (incremental input),
        memory and files: no rank reads a depth again once a deeper one exists below ``depth``."""
        self.flush_writes()
        self._prefetched = None
        lower = sorted(level for level in self._depths if level < depth)
        for level in lower[:-1]:
            for tier in self._depths.pop(level).tiers:
                tier.close()

    # --------------------------------------------------------------- metrics
    def tier_bytes(self, name: str) -> int:
        return sum(t.nbytes for entry in self._depths.values() for t in entry.tiers if t.name == name)

    def _budget_used(self, name: str) -> int:
        """Bytes held in tier ``name`` by this cache and those it shares its budgets with."""
        return self.tier_bytes(name) + sum(other.tier_bytes(name) for other in self.budget_sharers)

    def take_counts(self) -> EpochCounts:
        """The counts since the last call."""
        counts, self.counts = self.counts, EpochCounts()
        return counts

    def _release(self) -> None:
        """Free every depth's memory and files."""
        self.flush_writes()
        self._prefetched = None
        for entry in self._depths.values():
            for tier in entry.tiers:
                tier.close()
        self._depths.clear()

    def close(self, remove_files: bool) -> None:
        self.flush_writes()
        self._prefetched = None
        self._depths.clear()
        self.budget_sharers.clear()
        if remove_files:
            for path in {self.directory, self.spill_directory}:
                shutil.rmtree(path, ignore_errors=True)
