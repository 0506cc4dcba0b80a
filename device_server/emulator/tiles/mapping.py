"""Tile mappings: which tiles hold which elements of a tensor.

A tensor's elements (row-major) are cut into contiguous intervals, one per tile, over a run
of consecutive tiles ``first, first + 1, ..., first + tiles - 1`` (wrapping around the chip).
Most mappings are *even* (every tile of the run holds ``elements // tiles`` elements, the first
``elements % tiles`` one more), which is stored in four integers; an *irregular* mapping
(a test forcing an unbalanced layout, say) stores its per-tile counts.

:class:`Allocator` hands out mappings the way Poplar's ``mapTensorLinearly`` does (spread over
as many tiles as hold at least ``min_bytes_per_tile`` each), with one difference: tensors that
use only part of the chip start where the previous such tensor ended, so that small tensors do
not all pile onto tile 0.

A *sliceable* mapping (``Allocator.sliceable``, ``slices > 1``) is the layout Poplar gives a
tensor that is sliced along its first dimension (popops' ``createSliceableTensor``, a loop's
per-iteration stash): each tile holds a piece of the unsliced elements for every one of the
``slices`` positions, so one slice is spread over all the mapping's tiles. Its per-tile counts
are those of an even mapping; ``slices`` says which elements sit where.

:func:`poputil_linear` is the layout a Poplar program gives a variable with
``poputil::mapTensorLinearly`` (the ``variable_mapping="linear"`` option): contiguous slices of
the flattened tensor on tiles 0, 1, 2, ... in order, by poputil's rule (see the function). Its
mapping is flagged ``linear``: a matmul or convolution that broadcasts such an operand
rearranges it into a copy in its own layout first (``matmul.rearrangement``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from device_server.emulator.tiles.irinfo import shape_elems, shape_itemsize
from device_server.protocol import ir_pb2

__all__ = ["VARIABLE_MAPPINGS", "Allocator", "TileMapping", "check_variable_mapping", "poputil_linear",
           "variable_mappings"]

#: How variables are laid out (the ``variable_mapping`` option): "consumer", as their first
#: consumer wants them (Graphcore's TensorFlow, its allocation finder), or "linear"
#: (``poputil::mapTensorLinearly``, as a Poplar program may map them: ``poputil_linear``).
VARIABLE_MAPPINGS = ("consumer", "linear")


class TileMapping:
    """Elements of one tensor over a run of tiles (see module docstring)."""

    __slots__ = ("first", "tiles", "elements", "total_tiles", "counts", "slices", "linear")

    def __init__(self, first: int, tiles: int, elements: int, total_tiles: int,
                 counts: np.ndarray | None = None, slices: int = 1, linear: bool = False) -> None:
        if not 0 < tiles <= total_tiles:
            raise ValueError(f"a mapping needs 1..{total_tiles} tiles, received tiles={tiles}.")
        self.first = int(first) % total_tiles
        self.tiles = int(tiles)
        self.elements = int(elements)
        self.total_tiles = int(total_tiles)
        if counts is not None:
            counts = np.asarray(counts, dtype=np.int64)
            if counts.shape != (tiles,) or int(counts.sum()) != elements:
                raise ValueError(
                    f"irregular mapping: counts must be {tiles} numbers summing to {elements}, "
                    f"received shape {counts.shape} summing to {int(counts.sum())}."
                )
        self.counts = counts
        # > 1: sliceable along the first dimension (each tile holds part of every slice)
        self.slices = max(1, int(slices))
        # a variable mapped by poputil::mapTensorLinearly (poputil_linear), not for its consumer
        self.linear = bool(linear)

    @classmethod
    def on_tiles(cls, counts_by_tile: dict[int, int], total_tiles: int) -> TileMapping:
        """An irregular mapping from ``{tile: elements}`` (tiles must form one run)."""
        tiles = sorted(counts_by_tile)
        first, last = tiles[0], tiles[-1]
        counts = np.zeros(last - first + 1, np.int64)
        for t, c in counts_by_tile.items():
            counts[t - first] = c
        return cls(first, len(counts), int(counts.sum()), total_tiles, counts)

    @property
    def even(self) -> bool:
        return self.counts is None

    @property
    def max_elements(self) -> int:
        """Elements on the fullest tile."""
        if self.counts is not None:
            return int(self.counts.max())
        return -(-self.elements // self.tiles)

    @property
    def max_tile(self) -> int:
        """Index of the fullest tile."""
        if self.counts is not None:
            return (self.first + int(self.counts.argmax())) % self.total_tiles
        return self.first

    def same_as(self, other: TileMapping | None) -> bool:
        """Whether both mappings put the same element indices on the same tiles."""
        if other is None or other.elements != self.elements or other.slices != self.slices:
            return False
        if self.counts is not None or other.counts is not None:
            return (
                other.first == self.first and other.tiles == self.tiles
                and self.counts is not None and other.counts is not None
                and bool(np.array_equal(self.counts, other.counts))
            )
        return other.first == self.first and other.tiles == self.tiles

    def _runs(self) -> list[tuple[int, int, int]]:
        """(start tile, stop tile, offset into the run) slices, at most two (wrap-around)."""
        end = self.first + self.tiles
        if end <= self.total_tiles:
            return [(self.first, end, 0)]
        head = self.total_tiles - self.first
        return [(self.first, self.total_tiles, 0), (0, end - self.total_tiles, head)]

    def add_to(self, vec: np.ndarray, bytes_per_element: float) -> None:
        """Adds this tensor's bytes on each tile into ``vec`` (one entry per tile)."""
        if self.counts is not None:
            for a, b, off in self._runs():
                vec[a:b] += self.counts[off:off + (b - a)] * bytes_per_element
            return
        base, extra = divmod(self.elements, self.tiles)
        for a, b, off in self._runs():
            if base:
                vec[a:b] += base * bytes_per_element
            if extra > off:
                vec[a:a + min(b - a, extra - off)] += bytes_per_element

    def elements_on(self, tile: int) -> int:
        """Elements held by ``tile``."""
        off = (tile - self.first) % self.total_tiles
        if off >= self.tiles:
            return 0
        if self.counts is not None:
            return int(self.counts[off])
        base, extra = divmod(self.elements, self.tiles)
        return base + (1 if off < extra else 0)

    def covers(self, vec: np.ndarray, value: float) -> None:
        """Adds ``value`` on every tile of the run (code and vertex state)."""
        for a, b, _ in self._runs():
            vec[a:b] += value

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"first_tile": self.first, "tiles": self.tiles,
                                "elements": self.elements}
        if self.counts is not None:
            d["counts"] = [int(c) for c in self.counts]
        if self.slices > 1:
            d["slices"] = self.slices
        return d

    def __repr__(self) -> str:
        kind = "even" if self.counts is None else "irregular"
        if self.slices > 1:
            kind += f", sliceable x{self.slices}"
        last = (self.first + self.tiles - 1) % self.total_tiles
        return (f"TileMapping({self.elements} elements on tiles {self.first}..{last}, "
                f"{kind}, max {self.max_elements}/tile)")


class Allocator:
    """Hands out linear mappings over a chip of ``total_tiles`` tiles."""

    def __init__(self, total_tiles: int, min_bytes_per_tile: int) -> None:
        self.total_tiles = total_tiles
        self.min_bytes_per_tile = max(1, int(min_bytes_per_tile))
        self.cursor = 0

    def linear(self, elements: int, itemsize: int, max_tiles: int = 0) -> TileMapping:
        """Spread ``elements`` over as many tiles as hold ``min_bytes_per_tile`` each."""
        elements = max(1, int(elements))
        want = -(-elements * max(1, itemsize) // self.min_bytes_per_tile)
        cap = self.total_tiles if max_tiles <= 0 else min(max_tiles, self.total_tiles)
        return self.spread(elements, max(1, min(cap, want, elements)))

    def sliceable(self, elements: int, itemsize: int, slices: int) -> TileMapping:
        """A tensor of ``elements`` sliced along its first dimension (``slices`` positions)
        laid out as popops' ``createSliceableTensor`` does: the sliced dimension whole on
        every tile, the ``elements / slices`` unsliced elements split evenly over as many
        tiles as the chip has (``ceil(unsliced / tiles)`` each), starting at tile 0; no tile
        holds less than ``min_bytes_per_tile`` in all (the linear layouts' grain)."""
        elements = max(1, int(elements))
        slices = max(1, min(int(slices), elements))
        unsliced = max(1, elements // slices)
        per_slice_bytes = max(1, itemsize) * slices
        grain = max(-(-unsliced // self.total_tiles), -(-self.min_bytes_per_tile // per_slice_bytes))
        tiles = max(1, min(self.total_tiles, -(-unsliced // grain)))
        return TileMapping(0, tiles, elements, self.total_tiles, slices=slices)

    def spread(self, elements: int, tiles: int) -> TileMapping:
        """``elements`` evenly over ``tiles`` tiles (all tiles start at tile 0; fewer start
        where the previous partial allocation ended)."""
        tiles = max(1, min(int(tiles), self.total_tiles, max(1, int(elements))))
        if tiles >= self.total_tiles:
            return TileMapping(0, self.total_tiles, elements, self.total_tiles)
        first = self.cursor
        self.cursor = (self.cursor + tiles) % self.total_tiles
        return TileMapping(first, tiles, elements, self.total_tiles)


def poputil_linear(elements: int, itemsize: int, total_tiles: int, *, vector_bytes: int = 8,
                   min_bytes_per_tile: int = 128) -> TileMapping:
    """The mapping ``poputil::mapTensorLinearly(graph, t)`` gives a tensor of ``elements``
    elements of ``itemsize`` bytes on a chip of ``total_tiles`` tiles (graphcore/poplibs
    lib/poputil/TileMapping.cpp ``calcLinearTileMapping``, which calls ``splitRegions`` of
    lib/poputil/Util.cpp): the flattened tensor is cut into grains of the target's vector
    width (``vector_bytes`` / ``itemsize`` elements: ``getVectorWidth``, 64 bits); each
    tile takes ``ceil(grains / tiles)`` grains, raised so that no tile holds fewer than
    ``ceil(min_bytes_per_tile / itemsize)`` elements (poputil's 128 bytes); the grains are
    then spread over ``V = ceil(grains / per tile)`` tiles, tile ``v`` (0 .. V - 1, in order)
    holding grains ``v * grains // V`` up to ``(v + 1) * grains // V`` (the last grain may be
    short). Flagged ``linear``."""
    n = int(elements)
    size = int(itemsize)
    if n <= 0 or size <= 0 or total_tiles <= 0:
        raise ValueError(f"poputil_linear needs positive elements, itemsize and tiles, received "
                         f"elements={elements!r}, itemsize={itemsize!r}, total_tiles={total_tiles!r}.")
    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    grain = max(1, int(vector_bytes) // size)
    grains = ceil(n, grain)
    per_tile = ceil(grains, int(total_tiles))
    min_grains = ceil(ceil(int(min_bytes_per_tile), size), grain)
    if min_grains > 0:
        per_tile = max(per_tile, ceil(grains, max(1, grains // min_grains)))
    tiles = ceil(grains, per_tile)
    v = np.arange(tiles + 1, dtype=np.int64)
    ends = np.minimum(n, (v * grains // tiles) * grain)
    return TileMapping(0, tiles, n, int(total_tiles), np.diff(ends), linear=True)


def check_variable_mapping(value: object, what: str = "variable_mapping") -> str:
    """``value`` if it is one of ``VARIABLE_MAPPINGS``, else a ValueError naming ``what``."""
    if not isinstance(value, str) or value not in VARIABLE_MAPPINGS:
        raise ValueError(f"{what} must be 'consumer' (variables laid out as their first consumer "
                         f"wants them, Graphcore's TensorFlow) or 'linear' "
                         f"(poputil::mapTensorLinearly), not {value!r}.")
    return value


def variable_mappings(module: ir_pb2.Module, vector_bytes: int, min_bytes_per_tile: int,
                      tiles: int, kinds: Mapping[int, str] | None,
                      variable_mapping: str = "linear") -> dict[str, TileMapping]:
    """Entry parameter name -> its ``poputil_linear`` mapping, for every variable of
    ``module`` when ``variable_mapping`` is "linear" (none for "consumer"). A parameter is a
    variable if ``kinds`` (parameter number -> kind) says so, else if its ``source_type``
    does, else if an output aliases it (as the planner decides)."""
    if check_variable_mapping(variable_mapping) == "consumer":
        return {}
    kinds = kinds or {}
    aliased = {int(a.parameter_number) for a in module.aliases}
    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    out = {}
    for instr in entry.instructions:
        if instr.opcode != "parameter" or instr.shape.is_tuple or not shape_itemsize(instr.shape):
            continue
        n = instr.parameter_number
        kind = kinds.get(n) or (instr.source_type if instr.source_type in
                                ("argument", "variable", "constant") else "")
        if (kind or ("variable" if n in aliased else "argument")) == "variable":
            out[instr.name] = poputil_linear(max(1, shape_elems(instr.shape)), shape_itemsize(instr.shape),
                                             tiles, vector_bytes=vector_bytes,
                                             min_bytes_per_tile=min_bytes_per_tile)
    return out
