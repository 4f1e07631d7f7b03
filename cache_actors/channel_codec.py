"""The local channel's wire: frames, a schema-checked msgpack encoding, the handshake.

Frames. Each message is a 4-byte big-endian length and that many bytes of msgpack. No
length over ``MAX_FRAME`` is accepted: a bigger header ends the connection before
anything is allocated for it, and a frame's bytes are buffered only as they arrive
(``FrameReader``).

Together, a server's connections buffer at most ``FREE_BUFFERED`` bytes each and
``MAX_BUFFERED`` more between them (``BufferBudget``: 1 MiB each and 256 MiB shared, so
1.25 GiB for 1,024 connections, where each could hold a partial 64 MiB frame before): a
connection whose bytes would take more than is left is dropped (``WireError``), never
buffered. Honest requests of a few hundred objects stay under ``FREE_BUFFERED``; the
shared part holds 13 of the largest at once.

``MAX_FRAME`` = 64 MiB. The largest real message is a put/get ``ObjectBatch`` of the
largest batch (``MAX_BATCH_OBJECTS`` = 65,536 objects; keys up to ~200 characters
assumed): per object a key (2 + 200 bytes), a pool name (2 + up to 64), an offset
(<= 9) and a size (<= 5), ~282 bytes, so 18.5 MB for the batch (measured: 18,481,173
bytes); a group query carries one key per page (13.2 MB for 65,536 pages); a reply at
most 9 bytes per object (0.6 MB). 64 MiB leaves 3.6 times the largest.

Decoding never amplifies a frame much: no array longer than ``MAX_ITEMS``
(``MAX_BATCH_OBJECTS``: no message needs more), no map longer than ``MAX_MAP``, no string
longer than ``MAX_STR``, no bin type at all, and no message of more than ``MAX_DECODED``
values (the items of every array and map, and the containers themselves: the largest
real message, a put of ``MAX_BATCH_OBJECTS`` objects, has four lists of that many). The
count is kept while decoding (a hook per container, so free for scalars): a message over
it stops at the first container past the budget, having built at most ``MAX_DECODED``
values and one array more. Every value costs at most ~72 bytes beside its own bytes (an
empty map; 1 byte on the wire), so one message decodes to at most ~30 MB beside its
frame, whatever the frame holds (64 MiB of empty maps decoded whole took ~4.6 GB). A
body of at most ``MAX_DECODED`` bytes cannot hold more values than that and is decoded
without the count (every request of a few hundred objects: the hooks would cost ~5 us).
A frame's body is handed to the decoder without a copy when it is the only one buffered
(``FrameReader``).

Encoding. Plain msgpack values (None, bool, int, float, str, lists, str-keyed maps;
tuples travel as lists) and exactly the classes in ``_CLASSES`` (``ObjectBatch``,
``PoolQuery``, ``PoolTransferResult``, ``OwnerClaim``) as the list of their fields, in
order (those their constructor takes: ``OwnerClaim.purpose`` never travels). In a
request their places are known from the op's argument types (``Signature``); a reply
value (the client has no schema) wraps the list in a msgpack extension type naming the
class. Either way each field is checked against its annotation (a ``StrEnum`` field
comes back as that enum). Nothing else can be decoded: there is no pickle, no class
lookup by name. Errors travel as ``[name, message]``: an exception of one of the server's
``passthrough`` types under the name of its nearest class in ``_ERRORS`` (``ValueError``,
``RuntimeError``, the ``NodeUnavailableError`` family, ``UnknownPoolError``), raised
again as that class on the caller's side; any other as a ``RuntimeError`` naming it
(and any other name comes back as ``RuntimeError``).

Messages. A connection begins with a hello each way, ``[MAGIC, PROTOCOL, raykv
version]`` (client first): peers whose ``PROTOCOL`` differ refuse each other with a
``ChannelVersionError`` naming both raykv versions. A request is ``[op, deadline,
args]``: ``deadline`` in ``time.monotonic()`` seconds (``CLOCK_MONOTONIC``, one clock
for every process of a node); a reply is ``[True, value]`` or ``[False, [error name,
message]]``. Requests are checked against the op's argument types (``Signature``) before
any handler sees them. A connection's first request may be ``BIND_OP`` with the rank's
``OwnerClaim``: the server then serves that connection as that owner (see
``node.channel_server``).
"""

from __future__ import annotations

import dataclasses
import enum
import reprlib
import struct
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from types import NoneType

import msgpack
from raykv.cache_actors.errors import (
    DeadlineExceededError,
    NodeUnavailableError,
    StalePoolsError,
    StoreUnavailableError,
    UnknownPoolError,
)
from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.deployments import PoolQuery
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS, ObjectBatch
from raykv.controllers.ownership import OwnerClaim

PROTOCOL = 4
"""The wire's version: raise it on any change to frames, messages or ``_CLASSES``."""

MAGIC = "raykv-channel"
BIND_OP = "bind"
"""The op of a connection's optional first request: ``[BIND_OP, deadline, [claim]]``."""
try:
    RAYKV_VERSION = metadata.version("raykv")
except metadata.PackageNotFoundError:  # run from a source tree that is not installed
    RAYKV_VERSION = "unknown"

MAX_FRAME = 64 << 20
"""Bytes of one message, at most (see the module docstring for the sum)."""
MAX_ITEMS = MAX_BATCH_OBJECTS
"""Items of one array, at most."""
MAX_MAP = 1024
"""Entries of one map, at most."""
MAX_STR = 1 << 20
"""Bytes of one string, at most."""
MAX_DECODED = 4 * MAX_BATCH_OBJECTS + 4096
"""Values one message may decode to: every array's and map's items (a map entry counts
two) and the containers themselves (see the module docstring)."""

_LEN = struct.Struct("!I")
FREE_BUFFERED = 1 << 20
"""Bytes a server's connection may buffer without drawing on ``MAX_BUFFERED``."""
MAX_BUFFERED = 256 << 20
"""Bytes a server's connections may buffer together beyond ``FREE_BUFFERED`` each."""
HEADER = _LEN.size
_CHUNK = 1 << 16  # bytes asked of one recv while a frame's size is unknown
_BIG_CHUNK = 1 << 20  # ... and at most, once a big frame's size is known


class WireError(ValueError):
    """Bytes from the peer that are not a valid message of this protocol."""


class ChannelVersionError(RuntimeError):
    """The two ends of a channel run raykv versions whose wires differ. Not retryable:
    run the same raykv version on ranks and node actors."""


def frame(body: bytes) -> bytes:
    """``body`` with its length header; ``ValueError`` over ``MAX_FRAME``."""
    if len(body) > MAX_FRAME:
        raise ValueError(f"a channel message of {len(body)} bytes exceeds the limit of "
                         f"{MAX_FRAME} bytes; send fewer objects per call")
    return _LEN.pack(len(body)) + body


class BufferBudget:
    """The bytes a server's connections may buffer together beyond ``FREE_BUFFERED``
    each (``limit``; see the module docstring). Thread-safe."""

    def __init__(self, limit: int = MAX_BUFFERED) -> None:
        self._limit = limit
        self._used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Take ``n`` bytes if that many are left; whether they were."""
        with self._lock:
            if self._used + n > self._limit:
                return False
            self._used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._used -= n

    @property
    def used(self) -> int:
        return self._used


class FrameReader:
    """Frames out of a byte stream, buffering no more than the frame being read
    (``MAX_FRAME`` at most), and with a ``budget`` no more beyond ``FREE_BUFFERED`` than
    it grants (``feed`` raises ``WireError`` otherwise; ``release`` gives it all back:
    call it when the connection ends). One reader per connection, used by one thread at
    a time."""

    def __init__(self, budget: BufferBudget | None = None) -> None:
        self._buf = bytearray()
        self._budget = budget
        self._charged = 0  # bytes beyond FREE_BUFFERED taken from the budget

    def want(self) -> int:
        """How many bytes to ask of the next ``recv``: the rest of the current frame,
        between ``_CHUNK`` and ``_BIG_CHUNK``."""
        if len(self._buf) < HEADER:
            return _CHUNK
        (n,) = _LEN.unpack_from(self._buf)
        return max(_CHUNK, min(_BIG_CHUNK, HEADER + n - len(self._buf)))

    def feed(self, data: bytes) -> None:
        """Buffer ``data``; ``WireError`` (drop the peer) if the budget has no room for
        it (nothing is buffered then)."""
        over = len(self._buf) + len(data) - FREE_BUFFERED - self._charged
        if over > 0 and self._budget is not None:
            if not self._budget.take(over):
                raise WireError(f"the channel's connections buffer {MAX_BUFFERED} bytes "
                                "together at most, beyond what each may hold alone; "
                                "this one would take more")
            self._charged += over
        self._buf += data

    def release(self) -> None:
        """Drop what is buffered and give the budget back (the connection ended)."""
        self._buf = bytearray()
        self._settle()

    def _settle(self) -> None:
        """Give back what the budget granted beyond what is buffered now."""
        if self._budget is None:
            return
        extra = self._charged - max(0, len(self._buf) - FREE_BUFFERED)
        if extra > 0:
            self._charged -= extra
            self._budget.give(extra)

    def next(self) -> bytes | memoryview | None:
        """The next whole frame's body, removed from the buffer; None until one is
        complete. ``WireError`` for a header over ``MAX_FRAME`` (then drop the peer).
        When the frame is all that is buffered (the usual case: one request at a time)
        the body is a view of the buffer, which the reader then gives up, so a big frame
        is never copied."""
        buf = self._buf
        if len(buf) < HEADER:
            return None
        (n,) = _LEN.unpack_from(buf)
        if n > MAX_FRAME:
            raise WireError(f"a frame of {n} bytes announced, over the limit of {MAX_FRAME}")
        end = HEADER + n
        if len(buf) < end:
            return None
        if len(buf) == end:
            self._buf = bytearray()
            self._settle()
            return memoryview(buf)[HEADER:]
        with memoryview(buf) as view:
            body = bytes(view[HEADER:end])
        del buf[:end]
        self._settle()
        return body

    @property
    def pending(self) -> int:
        """Bytes buffered that are not yet a whole frame."""
        return len(self._buf)


# ------------------------------------------------------------------ checks by type
Check = Callable[[object], object]
"""Returns the value (converted: a tuple from a list, an enum from a str, an instance
of ``_CLASSES`` from its fields) or raises ``WireError``."""


def _fail(value: object, hint: object) -> typing.NoReturn:
    raise WireError(f"expected {hint}, got {reprlib.repr(value)}")  # bounded, however big


def _scalar(kind: type) -> Check:
    accepted = (int, float) if kind is float else (kind,)

    def check(v: object) -> object:
        if type(v) not in accepted:  # exact: a bool is no int here
            _fail(v, kind.__name__)
        return v
    return check


_STR = frozenset({str})


def _strs(v: object) -> object:
    if type(v) is list:
        if len(v) > 1024:  # joining a long list would copy all its text: look at types
            if set(map(type, v)) <= _STR:
                return v
        else:
            try:
                "".join(v)  # refuses any item that is not a str, at C speed
                return v
            except TypeError:
                pass
    _fail(v, "list[str]")


def _ints(v: object) -> object:
    try:  # sum refuses any item that is no number, and a float makes the sum a float
        if type(v) is list and type(sum(v)) is int:  # (a bool passes: it is an int)
            return v
    except TypeError:
        pass
    _fail(v, "list[int]")


def _list_of(item: object) -> Check:
    if item is str:
        return _strs
    if item is int:
        return _ints
    if item in _SCALARS:
        kinds = frozenset({int, float} if item is float else {item})

        def check(v: object) -> object:  # one C-level pass over the types
            if type(v) is not list or not set(map(type, v)) <= kinds:
                _fail(v, f"list[{item.__name__}]")
            return v
        return check
    inner = checker(item)

    def check_items(v: object) -> object:
        if type(v) is not list:
            _fail(v, "a list")
        return [inner(x) for x in v]
    return check_items


def _tuple_of(items: tuple) -> Check:
    if len(items) == 2 and items[1] is Ellipsis:
        each = _list_of(items[0])
        return lambda v: tuple(each(v))
    inner = [checker(t) for t in items]
    if all(t in (str, int, bool) for t in items):  # (int, int): nothing to convert
        kinds = list(items)

        def check_scalars(v: object) -> object:
            if type(v) is not list or list(map(type, v)) != kinds:
                _fail(v, f"a list of {len(kinds)}: {kinds}")
            return tuple(v)
        return check_scalars

    def check(v: object) -> object:
        if type(v) is not list or len(v) != len(inner):
            _fail(v, f"a list of {len(inner)}")
        return tuple([c(x) for c, x in zip(inner, v, strict=True)])
    return check


def _dict_of(key: object, value: object) -> Check:
    ck, cv = checker(key), checker(value)

    def check(v: object) -> object:
        if type(v) is not dict:
            _fail(v, "a map")
        return {ck(k): cv(x) for k, x in v.items()}
    return check


def _enum(kind: type[enum.StrEnum]) -> Check:
    members = {m.value: m for m in kind}  # a dict lookup: calling the enum costs ~1 us

    def check(v: object) -> object:
        member = members.get(v) if type(v) is str else None
        if member is None:
            _fail(v, f"one of {list(members)}")
        return member
    return check


def _fields_of(cls: type) -> Check:
    """An instance of dataclass ``cls`` from the list of its fields, in order, each
    checked against its annotation."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    checks = [checker(hints[n]) for n in names]

    def check(v: object) -> object:
        if type(v) is not list or len(v) != len(checks):
            _fail(v, f"the {len(checks)} fields of {cls.__name__}")
        fields = [c(x) for c, x in zip(checks, v, strict=False)]  # length checked
        try:
            return cls(*fields)
        except (TypeError, ValueError) as e:  # the class's own checks refused them
            raise WireError(f"not a valid {cls.__name__}: {e}") from None
    return check


_SCALARS = (str, int, float, bool)


def _union_of(options: tuple) -> Check:
    checks = [checker(o) for o in options]

    def check(v: object) -> object:
        for c in checks:
            try:
                return c(v)
            except WireError:
                continue
        _fail(v, " or ".join(map(str, options)))
    return check


def checker(hint: object) -> Check:
    """The check of values of type ``hint``: str, int, float, bool, None, ``list[T]``,
    ``tuple[T, ...]``, ``tuple[A, B, ...]``, ``dict[K, V]``, ``A | B``, a ``StrEnum``, or
    a class of ``_CLASSES`` (sent as the list of its fields). ``TypeError`` for any other
    (a programming error, found when the check is built)."""
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_of(params)
    if hint in _SCALARS:
        return _scalar(hint)
    if hint is None or hint is NoneType:
        return lambda v: v if v is None else _fail(v, "None")
    if origin is list:
        return _list_of(params[0])
    if origin is tuple:
        return _tuple_of(params)
    if origin is dict:
        return _dict_of(*params)
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return _enum(hint)
    if hint in _FIELDS:
        return _FIELDS[hint][1]
    raise TypeError(f"the channel cannot carry values of type {hint!r}")


# --------------------------------------------------------- classes on the wire
_CLASSES: tuple[type, ...] = (ObjectBatch, PoolQuery, PoolTransferResult, OwnerClaim)
"""The classes that travel: a request argument (its type known from the op's
``Signature``) as the plain list of its fields; a reply value (the client has no
schema) as extension type ``1 + index here`` holding that list."""
_FIELDS: dict[type, tuple[tuple[str, ...], Check]] = {}
for _cls in _CLASSES:  # in order: a class's fields may be of classes before it
    _FIELDS[_cls] = (tuple(f.name for f in dataclasses.fields(_cls) if f.init),
                     _fields_of(_cls))
_BY_CODE = {code: _FIELDS[cls][1] for code, cls in enumerate(_CLASSES, start=1)}
_CODE = {cls: code for code, cls in enumerate(_CLASSES, start=1)}

_LIMITS = dict(max_str_len=MAX_STR, max_bin_len=0, max_array_len=MAX_ITEMS,
               max_map_len=MAX_MAP, max_ext_len=MAX_FRAME)


def _fields(value: object) -> object:
    """A request argument as it travels: an instance of ``_CLASSES`` (or a list or
    tuple of them) as its field lists, anything else as itself."""
    names = _FIELDS.get(type(value), ((),))[0]
    if names:
        return [getattr(value, n) for n in names]
    if type(value) in (list, tuple) and value and type(value[0]) in _FIELDS:
        return [_fields(v) for v in value]
    return value


def _tagged(value: object) -> object:
    """A reply value as it travels: an instance of ``_CLASSES`` as its extension
    type."""
    code = _CODE.get(type(value))
    if code is None:
        return value
    return msgpack.ExtType(code, msgpack.packb(_fields(value)))


def _no_ext(code: int, data: bytes) -> object:
    raise WireError(f"extension type {code} where none may be")


def _ext(code: int, data: bytes) -> object:
    check = _BY_CODE.get(code)
    if check is None:
        raise WireError(f"unknown extension type {code}")
    return check(msgpack.unpackb(data, ext_hook=_no_ext, **_LIMITS))


def _unpack(body: bytes | memoryview, tagged: bool) -> object:
    """``body`` decoded within ``MAX_DECODED`` values (the extension types' contents
    counted too), with the extension types of ``_CLASSES`` if ``tagged``. A body of at
    most ``MAX_DECODED`` bytes is decoded as it is: every value takes a byte at least,
    so it cannot hold more (the usual request costs nothing for the count)."""
    if len(body) <= MAX_DECODED:
        return msgpack.unpackb(body, ext_hook=_ext if tagged else _no_ext, **_LIMITS)
    left = MAX_DECODED

    def on_list(v: list) -> list:
        nonlocal left
        left -= 1 + len(v)
        if left < 0:
            raise WireError(f"a message of more than MAX_DECODED={MAX_DECODED} values")
        return v

    def on_map(v: dict) -> dict:
        nonlocal left
        left -= 1 + 2 * len(v)
        if left < 0:
            raise WireError(f"a message of more than MAX_DECODED={MAX_DECODED} values")
        return v

    def on_ext(code: int, data: bytes) -> object:
        check = _BY_CODE.get(code)
        if check is None:
            raise WireError(f"unknown extension type {code}")
        return check(msgpack.unpackb(data, ext_hook=_no_ext, list_hook=on_list,
                                     object_hook=on_map, **_LIMITS))

    return msgpack.unpackb(body, ext_hook=on_ext if tagged else _no_ext, list_hook=on_list,
                           object_hook=on_map, **_LIMITS)


def encode(obj: object) -> bytes:
    """One framed message of plain msgpack values (and ``_tagged``'s extension types);
    ``TypeError`` for a value the channel cannot carry."""
    return frame(msgpack.packb(obj))


def decode(body: bytes | memoryview, tagged: bool = False) -> object:
    """One message body: plain msgpack values, and with ``tagged`` the extension types
    of ``_CLASSES``. ``WireError`` for anything else, or over the limits (see the module
    docstring: what it builds is bounded before it is built)."""
    try:
        return _unpack(body, tagged)
    except WireError:
        raise
    except Exception as e:  # msgpack's own errors, a bad field, bad UTF-8, ...
        if "max_array_len" in str(e):
            raise WireError(f"a list of more than MAX_BATCH_OBJECTS={MAX_BATCH_OBJECTS} "
                            "items in one channel message: send fewer objects per call "
                            f"({e})") from None
        raise WireError(f"undecodable message ({type(e).__name__}: {e})") from None


# -------------------------------------------------------------------- handshake
def hello() -> bytes:
    """This end's hello, framed."""
    return encode([MAGIC, PROTOCOL, RAYKV_VERSION])


def check_hello(message: object, peer: str) -> None:
    """``WireError`` if ``message`` is no hello; ``ChannelVersionError`` naming both
    versions if the ``peer`` ("rank" / "node actor") speaks another protocol."""
    if (type(message) is not list or len(message) != 3 or message[0] != MAGIC
            or type(message[1]) is not int or type(message[2]) is not str):
        raise WireError(f"not a raykv channel hello: {str(message)[:80]}")
    if message[1] != PROTOCOL:
        raise ChannelVersionError(
            f"the {peer} runs raykv {message[2]} (channel protocol {message[1]}), this "
            f"process raykv {RAYKV_VERSION} (channel protocol {PROTOCOL}): run the same "
            "raykv version on ranks and node actors")


# --------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True)
class Signature:
    """The argument types of one op, in order."""

    args: tuple[object, ...]
    checks: tuple[Check, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checks", tuple(checker(a) for a in self.args))


def request(op: str, deadline: float, args: Sequence[object]) -> bytes:
    """A request, framed (``TypeError`` for an argument the channel cannot carry)."""
    return encode([op, deadline, [_fields(a) for a in args]])


def parse_request(body: bytes | memoryview,
                  signatures: Mapping[str, Signature]) -> tuple[str, float, list]:
    """``(op, deadline, args)`` of a request body whose op is in ``signatures`` and whose
    arguments have that op's arity and types; ``WireError`` otherwise."""
    message = decode(body)
    if type(message) is not list or len(message) != 3:
        _fail(message, "a request [op, deadline, args]")
    op, deadline, args = message
    signature = signatures.get(op) if type(op) is str else None
    if signature is None:
        _fail(op, f"an op of {sorted(signatures)}")
    if type(deadline) not in (int, float):
        _fail(deadline, "a deadline (seconds)")
    if type(args) is not list or len(args) != len(signature.checks):
        _fail(args, f"{len(signature.checks)} arguments of {op}")
    return op, deadline, [c(a) for c, a in zip(signature.checks, args, strict=False)]


# ----------------------------------------------------------------------- replies
_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    ValueError, RuntimeError, NodeUnavailableError, StoreUnavailableError,
    StalePoolsError, DeadlineExceededError, UnknownPoolError)}


def error_name(error: BaseException) -> str | None:
    """The name ``error`` travels under: its nearest class in ``_ERRORS``; None if it
    has none."""
    for cls in type(error).__mro__:
        if _ERRORS.get(cls.__name__) is cls:
            return cls.__name__
    return None


def reply(value: object) -> bytes:
    """A successful reply, framed."""
    return encode([True, _tagged(value)])


def error_reply(name: str, message: str) -> bytes:
    """A failed reply, framed: ``name`` must be a key of ``_ERRORS``."""
    return encode([False, [name, message]])


def parse_reply(body: bytes | memoryview) -> tuple[bool, object]:
    """``(True, value)`` or ``(False, exception)`` of a reply body; ``WireError`` if it
    is none."""
    message = decode(body, tagged=True)
    if type(message) is not list or len(message) != 2 or type(message[0]) is not bool:
        _fail(message, "a reply [ok, value]")
    ok, value = message
    if ok:
        return True, value
    if (type(value) is not list or len(value) != 2 or type(value[0]) is not str
            or type(value[1]) is not str):
        _fail(value, "an error [name, message]")
    name, text = value
    cls = _ERRORS.get(name)
    return False, cls(text) if cls is not None else RuntimeError(f"{name}: {text}")
