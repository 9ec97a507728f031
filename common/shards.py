"""Relay shards: how a region's parameters are split between S relay processes.

A region's relay may run as S processes (``hypertrain-relay --shard i/S``), each owning
one contiguous range of the flat parameter vector.  The rule (docs/design.md §4.9):

    a = lcm(regional codec's encode unit, global codec's encode unit)
    U = ceil(P / a)                      # units of a values; the last may be short
    shard i owns units [floor(i U / S), floor((i + 1) U / S)),
    i.e. values [a floor(i U / S), min(P, a floor((i + 1) U / S)))

so the shards are in order, cover every value once, differ in size by at most one
unit, and every boundary is a multiple of both codecs' units (int8 blocks, SparseLoCo
chunks).  Each shard's encoding is then exactly the matching part of the whole's
(``Codec.encode_unit``), every per-value operation of the round (error feedback, the
fixed-order mean, the base update, the outer step) is the same, and a sharded run ends
on the same parameters, bit for bit, as one relay per region.

Member ids: with S = 1 a relay is its region (``"eu"``), as before shards existed;
with S > 1 shard i of region r is ``"r/i"`` (``/`` is not allowed in region names),
and signs with the key ``relay-r-i``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypertrain.common.codec import make_codec
from hypertrain.common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Shards:
    """The split of ``numel`` parameters into ``count`` ranges (see the module docstring)."""

    count: int
    numel: int
    unit: int

    def __post_init__(self) -> None:
        units = -(-self.numel // self.unit)
        if self.count < 1:
            raise ConfigError(f"relay shards must be >= 1, got {self.count}")
        if self.count > max(1, units):
            raise ConfigError(
                f"{self.count} relay shards for {self.numel} parameters: each shard needs at "
                f"least one unit of {self.unit} values (the least common multiple of the "
                f"regional and global codecs' blocks or chunks), so at most {units} shards"
            )

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def bounds(self, i: int) -> tuple[int, int]:
        """The values ``[start, end)`` shard ``i`` owns."""
        if not 0 <= i < self.count:
            raise ConfigError(f"shard {i} of {self.count} does not exist")
        units = -(-self.numel // self.unit)
        lo, hi = i * units // self.count, (i + 1) * units // self.count
        return min(self.numel, lo * self.unit), min(self.numel, hi * self.unit)

    def all_bounds(self) -> list[tuple[int, int]]:
        return [self.bounds(i) for i in range(self.count)]

    def member(self, region: str, i: int) -> str:
        """The member id of shard ``i`` of ``region``'s relay (its region when S = 1)."""
        self.bounds(i)
        return relay_member(region, i, self.count)

    def members(self, regions: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """Every relay member id (``relay_members``)."""
        return relay_members(regions, self.count)

    def split(self, member: str) -> tuple[str, int]:
        """(region, shard) of a relay member id (``ConfigError`` if it is not one)."""
        region, sep, index = member.partition("/")
        if self.count == 1:
            if sep:
                raise ConfigError(f"{member!r}: this run's relays are not sharded")
            return region, 0
        if not sep or not index.isdigit() or not 0 <= int(index) < self.count:
            raise ConfigError(f"{member!r} is not a relay shard of this run (S = {self.count})")
        return region, int(index)

    def label(self, i: int) -> str:
        """``"i/S"`` (what islands bind into each shard's signed transfer); "" when S = 1."""
        return f"{i}/{self.count}" if self.count > 1 else ""


def relay_member(region: str, i: int, count: int) -> str:
    """The member id of shard ``i`` of ``count`` of ``region``'s relay: the region itself
    when it is not sharded, else ``region/i`` (the one place this rule is written)."""
    return region if count == 1 else f"{region}/{i}"


def relay_members(regions: tuple[str, ...] | list[str], count: int) -> tuple[str, ...]:
    """The member ids of the relays of ``regions`` with ``count`` shards each, shard by
    shard, each shard's regions in sorted order (the order the aggregator sums them)."""
    return tuple(relay_member(r, i, count) for i in range(count) for r in sorted(regions))


def shard_unit(regional_codec: str, global_codec: str) -> int:
    """The values every shard boundary is a multiple of."""
    return math.lcm(make_codec(regional_codec).encode_unit, make_codec(global_codec).encode_unit)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/S"`` -> (i, S), with ``0 <= i < S`` (``ConfigError`` naming the problem)."""
    index, sep, count = text.partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit():
        raise ConfigError(f"--shard must look like i/S (e.g. 0/2), got {text!r}")
    i, s = int(index), int(count)
    if s < 1 or not 0 <= i < s:
        raise ConfigError(f"--shard {text}: need S >= 1 and 0 <= i < S")
    return i, s
