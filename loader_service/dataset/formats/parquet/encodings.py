"""Levels, dictionary indices and PLAIN values: the RLE/bit-packed hybrid walked run by run with
bounded work, and the values one asks for read without decoding the rest."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loader_service.dataset.formats.parquet.pagemodel import (
    BIT_SHIFTS,
    BYTE_BITS,
    MAX_RUNS,
    PIECE,
    SWAR_BYTES,
    U32,
    ParquetPageError,
)


@dataclass(frozen=True)
class Packed:
    """A bit-packed run's values, packed from the lowest bit up; ``data`` holds all of them."""

    data: memoryview
    bit_width: int
    count: int

    def at(self, index: int) -> int:
        """One value, without unpacking those before it."""
        bit = index * self.bit_width
        word = int.from_bytes(self.data[bit >> 3 : (bit + self.bit_width + 7) >> 3], "little")
        return (word >> (bit & 7)) & ((1 << self.bit_width) - 1)

    def tally(self, start: int, stop: int, value: int) -> tuple[int, int]:
        """How many of the values [start, stop) are ``value``, and how many are above it.

        Widths that divide 8 (every level width up to a max level of 15) are counted on whole
        bytes as 64-bit words, without unpacking: a 1 MiB page's levels in well under a millisecond.
        """
        per_byte = 8 // self.bit_width if self.bit_width in (1, 2, 4, 8) else 0
        if not per_byte:
            return self._tally_unpacked(start, stop, value)
        first, last = -(-start // per_byte), stop // per_byte
        if first >= last:
            return self._tally_each(range(start, stop), value)
        head = self._tally_each(range(start, first * per_byte), value)
        tail = self._tally_each(range(last * per_byte, stop), value)
        equal, above = 0, 0
        for lo in range(first, last, SWAR_BYTES):  # bounds the temporaries
            raw = np.frombuffer(self.data, dtype=np.uint8, count=min(SWAR_BYTES, last - lo), offset=lo)
            e, a = _swar_tally(raw, self.bit_width, value)
            equal, above = equal + e, above + a
        return head[0] + tail[0] + equal, head[1] + tail[1] + above

    def _tally_each(self, indices: range, value: int) -> tuple[int, int]:
        values = [self.at(i) for i in indices]
        return values.count(value), sum(v > value for v in values)

    def _tally_unpacked(self, start: int, stop: int, value: int) -> tuple[int, int]:
        equal, above = 0, 0
        for lo in range(start // 8 * 8, stop, PIECE):  # whole groups of 8 values: whole bytes
            hi = min(lo + PIECE, stop)
            data = self.data[lo // 8 * self.bit_width : (hi * self.bit_width + 7) // 8]
            values = unpack(data, self.bit_width, hi - lo)[max(start - lo, 0) :]
            equal += int(np.count_nonzero(values == value))
            above += int(np.count_nonzero(values > value))
        return equal, above


def _swar_tally(raw: npt.NDArray[np.uint8], bit_width: int, value: int) -> tuple[int, int]:
    """``Packed.tally`` of whole bytes of fields of ``bit_width`` (1, 2, 4 or 8) bits."""
    if bit_width == 8:
        return int(np.count_nonzero(raw == value)), int(np.count_nonzero(raw > value))
    whole = len(raw) // 8 * 8
    last = np.zeros(8, dtype=np.uint8)  # the bytes after the whole words, and fields of 0 after them
    last[: len(raw) - whole] = raw[whole:]
    padding = (8 - len(raw) + whole) * (8 // bit_width)
    equal, above = -padding if value == 0 else 0, 0
    for words in (raw[:whole].view(np.uint64), last.view(np.uint64)):  # a view: no copy of the page
        equal += _fields_equal(words, bit_width, value)
        above += sum(_fields_equal(words, bit_width, v) for v in range(value + 1, 1 << bit_width))
    return equal, above


def _fields_equal(words: npt.NDArray[np.uint64], bit_width: int, value: int) -> int:
    """How many ``bit_width``-bit fields of ``words`` hold ``value``: those whose bits all match."""
    fields = 64 // bit_width
    pattern = np.uint64(sum(value << (i * bit_width) for i in range(fields)))
    low_bits = np.uint64(sum(1 << (i * bit_width) for i in range(fields)))
    same = np.bitwise_xor(words, pattern)
    np.invert(same, out=same)  # in place: a fresh temporary of a page's size costs page faults
    all_same = same.copy() if bit_width > 1 else same
    for shift in range(1, bit_width):
        np.bitwise_and(all_same, same >> np.uint64(shift), out=all_same)
    np.bitwise_and(all_same, low_bits, out=all_same)
    return _popcount(all_same)


def _popcount(words: npt.NDArray[np.uint64]) -> int:
    if hasattr(np, "bitwise_count"):  # numpy 2
        return int(np.bitwise_count(words).sum())
    return int(BYTE_BITS[words.view(np.uint8)].sum())


Run = tuple[int, int, int | Packed]


def hybrid_runs(data: memoryview, bit_width: int, count: int, what: str) -> Iterator[Run]:
    """(first position, values, the value or the packed values) of the runs of an RLE/bit-packed
    hybrid stream, until ``count`` values; the last run is cut to end there."""
    value_bytes = (bit_width + 7) // 8
    pos, got, runs = 0, 0, 0
    while got < count:
        runs += 1
        if runs > MAX_RUNS:
            raise ParquetPageError(f"{what}: more than {MAX_RUNS} runs")
        header, pos = _uvarint(data, pos, what)
        n = header >> 1
        if n == 0:
            raise ParquetPageError(f"{what}: a run of no values at byte {pos}")
        if header & 1:  # n groups of 8 bit-packed values
            take = min(n * 8, count - got)
            size = (take * bit_width + 7) // 8
            if pos + size > len(data):
                raise ParquetPageError(f"{what}: ends inside a bit-packed run at byte {pos}")
            yield got, take, Packed(data[pos : pos + size], bit_width, take)
            pos += n * bit_width
        else:
            if pos + value_bytes > len(data):
                raise ParquetPageError(f"{what}: ends inside a run at byte {pos}")
            value = int.from_bytes(data[pos : pos + value_bytes], "little")
            pos += value_bytes
            if value >> bit_width:
                raise ParquetPageError(f"{what}: run value {value} is wider than {bit_width} bits")
            take = min(n, count - got)
            yield got, take, value
        got += take


def _uvarint(data: memoryview, pos: int, what: str) -> tuple[int, int]:
    value = 0
    for shift in range(0, 35, 7):  # a run header is 32 bits: 5 bytes
        if pos >= len(data):
            raise ParquetPageError(f"{what}: ends before all its values")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
    raise ParquetPageError(f"{what}: a run header longer than 5 bytes at byte {pos}")


def unpack(data: memoryview, bit_width: int, count: int) -> npt.NDArray[np.uint32]:
    """``count`` values of ``bit_width`` bits packed from the lowest bit of ``data`` up."""
    if bit_width == 0:
        return np.zeros(count, dtype=np.uint32)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[: count * bit_width]
    weighted = bits.reshape(count, bit_width).astype(np.uint32) << BIT_SHIFTS[:bit_width]
    out: npt.NDArray[np.uint32] = weighted.sum(axis=1, dtype=np.uint32)
    return out


def levels_at(data: memoryview, max_def: int, positions: Sequence[int], what: str) -> list[tuple[bool, int]]:
    """For each of the sorted ``positions`` of a page: whether its value is there (not null), and
    how many values there are before it (its place among the page's stored values)."""
    answers: list[tuple[bool, int]] = []
    present = 0  # values (not nulls) before the current position
    for first, n, run in hybrid_runs(data, max_def.bit_length(), positions[-1] + 1, what):
        done = 0  # the run's values counted in ``present``
        while len(answers) < len(positions) and positions[len(answers)] < first + n:
            at = positions[len(answers)] - first
            present += present_in_run(run, done, at, max_def, what)
            done = at
            level = run.at(at) if isinstance(run, Packed) else run
            answers.append((level == max_def, present))  # a level above the maximum raises below
        present += present_in_run(run, done, n, max_def, what)
    return answers


def present_in_run(run: int | Packed, start: int, stop: int, max_def: int, what: str) -> int:
    """How many of a run's values [start, stop) are there: at the maximum level, which none passes."""
    if isinstance(run, Packed):
        equal, above = run.tally(start, stop, max_def)
    else:
        equal, above = (stop - start, 0) if run == max_def else (0, (stop - start) * (run > max_def))
    if above:
        raise ParquetPageError(f"{what}: {above} levels above the maximum {max_def}")
    return equal


def indices_at(data: memoryview, keys: Sequence[int], what: str) -> list[int]:
    """The dictionary indices at the sorted ``keys`` of a dictionary-encoded page's values."""
    if not keys:
        return []
    if not data:
        raise ParquetPageError(f"{what}: no bit width")
    bit_width = data[0]
    if bit_width > 32:
        raise ParquetPageError(f"{what}: bit width {bit_width}")
    indices: list[int] = []
    for first, n, run in hybrid_runs(data[1:], bit_width, keys[-1] + 1, what):
        while len(indices) < len(keys) and keys[len(indices)] < first + n:
            at = keys[len(indices)] - first
            indices.append(run.at(at) if isinstance(run, Packed) else run)
    return indices


def plain_at(data: memoryview, keys: Sequence[int], what: str) -> list[bytes]:
    """The PLAIN byte arrays at the sorted ``keys``: each a 4-byte length and its bytes, so finding
    one means hopping over all before it (a few for images of many KB, thousands for small values)."""
    found: list[bytes] = []
    pos, index, end = 0, 0, len(data)
    for key in keys:
        while True:
            if pos + 4 > end:
                raise ParquetPageError(f"{what}: value {index} starts past the end ({end} bytes)")
            (size,) = U32.unpack_from(data, pos)
            if size > end - pos - 4:
                raise ParquetPageError(
                    f"{what}: value {index} of {size} bytes runs past the end ({end} bytes)"
                )
            if index == key:
                found.append(data[pos + 4 : pos + 4 + size].tobytes())
                break
            pos += 4 + size
            index += 1
    return found
