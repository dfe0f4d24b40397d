"""Wire rules declared beside each field, and the one generic codec that applies them.

A message is a frozen dataclass, and each field's annotation says what the wire may carry for it::

    slot: Annotated[int, Int(0, 65535)]                       # an int (never a bool) in bounds
    leases: Annotated[tuple[int, ...], ListOf(Int(), 4096)]   # a msgpack array, stored as a tuple
    resume: Annotated[str, Str(64), OMITTABLE] = ""           # older senders may leave it out
    feed: FeedInfo                                            # a nested dataclass: a map, same rules

``Record(cls)`` reads those declarations once. ``Record.build`` then checks a decoded msgpack map
field by field, refuses missing and unknown keys and builds the dataclass; ``Record.encode_into`` is
the inverse. A value that breaks a rule raises ``Invalid``, which names the field (and the item or
nested field) so the receiver's ``ProtocolError`` says exactly what was wrong.

Nothing here knows a message kind, a version or a socket: ``protocol.messages`` adds the envelope.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

_MAX_INT: Final = 2**62
_MAX_STR: Final = 512


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class Invalid(ProtocolError):
    """A value that breaks its rule.

    ``where`` grows as the error travels outwards (innermost place first), so the final message reads
    "item 0 of field 'bad' must be ..." whatever the nesting.
    """

    def __init__(self, reason: str, where: tuple[str, ...] = ()) -> None:
        self.reason = reason
        self.where = where
        super().__init__(" of ".join(where) + " " + reason if where else reason)

    @classmethod
    def field(cls, name: object, reason: str) -> Invalid:
        # A key from the wire may be long or bytes: its repr, cut short, is what the reader sees.
        return cls(reason, (f"field {name!r:.60}",))

    def within(self, place: str) -> Invalid:
        return Invalid(self.reason, (*self.where, place))


Check = Callable[[Any], Any]
"""A compiled rule: returns the value to store, or raises Invalid."""


class Rule:
    """What one field may hold on the wire. ``checker`` compiles it, once per record, into a closure:
    decoding then pays for a call and the test itself, not for reading the rule's attributes."""

    __slots__ = ()

    def checker(self) -> Check:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Int(Rule):
    """An integer in ``[lo, hi]``; bools are refused although Python counts them as ints."""

    lo: int = 0
    hi: int = _MAX_INT

    def checker(self) -> Check:
        lo, hi = self.lo, self.hi

        def check(value: Any) -> int:
            if type(value) is not int or not lo <= value <= hi:
                raise Invalid(f"must be an integer in [{lo}, {hi}], got {value!r:.80}")
            return value

        return check


@dataclass(frozen=True, slots=True)
class Float(Rule):
    """A number in ``[lo, hi]`` (an int is accepted and widened); NaN fails every comparison."""

    lo: float
    hi: float

    def checker(self) -> Check:
        lo, hi = self.lo, self.hi

        def check(value: Any) -> float:
            if type(value) not in (float, int) or not lo <= value <= hi:
                raise Invalid(f"must be a number in [{lo}, {hi}], got {value!r:.80}")
            return float(value)

        return check


@dataclass(frozen=True, slots=True)
class Str(Rule):
    max_len: int = _MAX_STR

    def checker(self) -> Check:
        max_len = self.max_len

        def check(value: Any) -> str:
            if type(value) is not str or len(value) > max_len:
                raise Invalid(f"must be a string of at most {max_len} characters")
            return value

        return check


@dataclass(frozen=True, slots=True)
class OneOf(Rule):
    """One of a fixed set of strings."""

    choices: tuple[str, ...]

    def checker(self) -> Check:
        choices = self.choices

        def check(value: Any) -> str:
            # The type test comes first: ``in`` compares with ==, which no wire object should reach.
            if type(value) is not str or value not in choices:
                raise Invalid(f"must be one of {', '.join(choices)}")
            return value

        return check


@dataclass(frozen=True, slots=True)
class Bool(Rule):
    def checker(self) -> Check:
        def check(value: Any) -> bool:
            if type(value) is not bool:
                raise Invalid("must be a boolean")
            return value

        return check


@dataclass(frozen=True, slots=True)
class PackedInt64(Rule):
    """A msgpack bin of whole little-endian int64 values, at most ``max_count`` of them."""

    max_count: int

    def checker(self) -> Check:
        max_count = self.max_count

        def check(value: Any) -> bytes:
            if type(value) is not bytes or len(value) > 8 * max_count or len(value) % 8:
                raise Invalid(f"must be bytes holding at most {max_count} whole int64 values")
            return value

        return check


@dataclass(frozen=True, slots=True)
class ListOf(Rule):
    """A msgpack array of at most ``max_len`` items, each checked by ``item``; stored as a tuple."""

    item: Rule
    max_len: int

    def checker(self) -> Check:
        max_len, item = self.max_len, self.item.checker()

        def check(value: Any) -> tuple[Any, ...]:
            if type(value) is not list or len(value) > max_len:
                raise Invalid(f"must be a list of at most {max_len} items")
            items = []
            for i, x in enumerate(value):
                try:
                    items.append(item(x))
                except Invalid as exc:
                    raise exc.within(f"item {i}") from None
            return tuple(items)

        return _int_list(self.item, max_len, check) if isinstance(self.item, Int) else check


def _int_list(item: Int, max_len: int, slow: Check) -> Check:
    # Lease lists run to thousands of items: one pass with no call per item; the general per-item
    # path (``slow``) runs only to name what is wrong.
    lo, hi = item.lo, item.hi

    def check(value: Any) -> Any:
        if (
            type(value) is not list
            or len(value) > max_len
            or any(type(x) is not int or not lo <= x <= hi for x in value)
        ):
            return slow(value)  # raises Invalid, naming the length or the first bad item
        return tuple(value)

    return check


@dataclass(frozen=True, slots=True)
class Pair(Rule):
    """A two-item msgpack array ``[first, second]``, stored as a tuple."""

    first: Rule
    second: Rule

    def checker(self) -> Check:
        first, second = self.first.checker(), self.second.checker()

        def check(value: Any) -> tuple[Any, Any]:
            if type(value) is not list or len(value) != 2:
                raise Invalid("must be a list of 2 items")
            try:
                head = first(value[0])
            except Invalid as exc:
                raise exc.within("item 0") from None
            try:
                return head, second(value[1])
            except Invalid as exc:
                raise exc.within("item 1") from None

        return check


@dataclass(frozen=True, slots=True)
class Items(Rule):
    """A msgpack array of exactly ``len(rules)`` items, item ``i`` checked by ``rules[i]``; a tuple."""

    rules: tuple[Rule, ...]

    def checker(self) -> Check:
        checks = tuple(r.checker() for r in self.rules)
        n = len(checks)

        def check(value: Any) -> tuple[Any, ...]:
            if type(value) is not list or len(value) != n:
                raise Invalid(f"must be a list of {n} items")
            out = []
            for i, (item, x) in enumerate(zip(checks, value, strict=True)):
                try:
                    out.append(item(x))
                except Invalid as exc:
                    raise exc.within(f"item {i}") from None
            return tuple(out)

        return check


@dataclass(frozen=True, slots=True)
class AnyMap(Rule):
    """A map whose content is informational, not a contract (keys are strings: strict_map_key)."""

    def checker(self) -> Check:
        def check(value: Any) -> dict[str, Any]:
            if type(value) is not dict:
                raise Invalid("must be a map")
            return value

        return check


class _Omittable:
    def __repr__(self) -> str:
        return "OMITTABLE"


OMITTABLE: Final = _Omittable()
"""Field marker: a frame without this key is valid and the field takes its default (fields added
after the first senders shipped). Without it a key must be present even when the field has a default."""

_ABSENT: Final = object()


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    check: Check
    default: Any  # _ABSENT when the key is required on the wire
    record: Record | None  # set for a nested dataclass, which encodes to a map of its own


def _field_plan(f: dataclasses.Field[Any], hint: Any) -> _Field:
    meta = getattr(hint, "__metadata__", ())
    rules = [m for m in meta if isinstance(m, Rule)]
    if len(rules) > 1:
        raise TypeError(f"field {f.name!r} declares {len(rules)} wire rules; give it one")
    # No rule: the type must be a dataclass, checked as a nested map by its own fields' rules.
    record = None if rules else Record(hint.__origin__ if meta else hint)
    rule: Rule = rules[0] if rules else typing.cast(Rule, record)
    default: Any = _ABSENT
    if OMITTABLE in meta:
        if f.default is dataclasses.MISSING:
            raise TypeError(f"field {f.name!r} is OMITTABLE but has no default")
        default = f.default
    return _Field(f.name, rule.checker(), default, record)


class Record(Rule):
    """The generic codec of one dataclass, compiled from its field declarations."""

    __slots__ = ("_cross_check", "_fields", "_keys", "_names", "_plan", "build", "cls")

    def __init__(self, cls: Any, envelope: tuple[str, ...] = ()) -> None:
        """``envelope``: keys the caller checks itself (a message's version and kind)."""
        _refuse_unbuildable(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        self.cls = cls
        self._fields = tuple(_field_plan(f, hints[f.name]) for f in dataclasses.fields(cls))
        self._plan = tuple((f.name, f.check, f.default) for f in self._fields)
        self._names = frozenset(f.name for f in self._fields) | frozenset(envelope)
        self._keys = len(self._fields) + len(envelope)
        # Checks that span fields (Hello's rank below world_size) live on the class, raising Invalid.
        self._cross_check: Callable[[Any], None] | None = getattr(cls, "cross_check", None)
        self.build = self._builder()

    def checker(self) -> Check:
        build = self.build

        def check(value: Any) -> Any:
            if type(value) is not dict:
                raise Invalid("must be a map")
            return build(value)

        return check

    def _builder(self) -> Callable[[dict[str, Any]], Any]:
        """``build``: the dataclass for a map, or Invalid naming the first field that breaks its rule.

        A closure, so the loop reads its plan from cells rather than from ``self`` on every frame.
        """
        plan, keys, cls = self._plan, self._keys, self.cls
        cross_check, unknown, new = self._cross_check, self._unknown, object.__new__

        def build(d: dict[str, Any]) -> Any:
            # The checked values go straight into the new instance's dict: a frozen __init__ would
            # set them again one by one through object.__setattr__, which on a 14-field Hello costs
            # more than all the checks. An instance left half-filled by a bad field is dropped.
            obj = new(cls)
            values = obj.__dict__
            absent = 0
            for name, check, default in plan:
                value = d.get(name, _ABSENT)
                if value is _ABSENT:
                    absent += 1
                    value = _default(name, default)
                else:
                    try:
                        value = check(value)
                    except Invalid as exc:
                        raise exc.within(f"field {name!r}") from None
                values[name] = value
            if len(d) + absent != keys:
                raise unknown(d)
            if cross_check is not None:
                cross_check(obj)
            return obj

        return build

    def _unknown(self, d: dict[str, Any]) -> Invalid:
        # Keys may mix str and bytes (strict_map_key allows both), so name the first, unsorted.
        extra = next((k for k in d if k not in self._names), "?")
        return Invalid.field(extra, "is not part of this message")

    def encode_into(self, body: dict[str, Any], obj: Any) -> dict[str, Any]:
        """Add ``obj``'s fields to ``body`` in declaration order: the key order on the wire."""
        for f in self._fields:
            value = getattr(obj, f.name)
            body[f.name] = value if f.record is None else f.record.encode_into({}, value)
        # Tuples need no conversion: msgpack packs a tuple as the same array as a list.
        return body


def _refuse_unbuildable(cls: Any) -> None:
    # Record's build fills the instance dict without calling __init__: a class whose __init__ must
    # run (it has a __post_init__) or whose instances have no dict (slots) is refused at import.
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} has no wire rule and is not a dataclass")
    if hasattr(cls, "__post_init__") or not hasattr(object.__new__(cls), "__dict__"):
        raise TypeError(f"{cls.__name__}: a wire record may have neither __post_init__ nor __slots__")


def _default(name: str, default: Any) -> Any:
    if default is _ABSENT:
        raise Invalid.field(name, "is missing")
    return default
