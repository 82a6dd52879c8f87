"""tierkv: an embeddable, crash-safe key-value store for DRAM, persistent memory and SSDs.

Keys and values are bytes; any buffer (bytearray, memoryview, ...) is accepted as input and
``str`` is refused with ``TypeError``.
"""

import os
import pathlib
from types import TracebackType
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type, TypeVar, Union, overload

# Anything with the buffer protocol (bytes, bytearray, memoryview, array.array, ...). Spelled
# as a union so the stubs need no typing_extensions at run time; str is refused.
BytesLike = Union[bytes, bytearray, memoryview]
_T = TypeVar("_T")

__version__: str
PRESETS: Tuple[str, ...]

class Error(Exception):
    """Base class of every error tierkv raises."""

class CorruptionError(Error):
    """Persistent data failed a checksum or structural check."""

    file: str
    offset: int
    detail: str

class InvalidArgument(Error, ValueError):
    """tierkv refused an argument (over-limit key or value, bad option, another preset's
    directory); nothing was written."""

class PmFullError(Error):
    """The persistent-memory region is full and cannot grow."""

class PoisonedError(Error):
    """The store refuses writes after an earlier unrecoverable failure; reopen it."""

class ClosedError(Error):
    """The Db (or the snapshot) has been closed."""

class LockedError(Error):
    """The store directory is open in another handle or process."""

def open(
    path: Union[str, "os.PathLike[str]"],
    preset: str = "native",
    *,
    create_if_missing: bool = ...,
    error_if_exists: bool = ...,
    pm_path: Optional[Union[str, "os.PathLike[str]"]] = ...,
    pm_sync: bool = ...,
    pm_write_latency_ns: int = ...,
    pm_write_bandwidth_mbps: int = ...,
    pm_read_latency_ns: int = ...,
    pm_profile: str = ...,
    pm_capacity: int = ...,
    pm_preallocate: bool = ...,
    pm_pool_size: int = ...,
    max_key_size: int = ...,
    max_value_size: int = ...,
    wal_recovery: str = ...,
    native: Dict[str, Any] = ...,
    pmekv: Dict[str, Any] = ...,
    slmdb: Dict[str, Any] = ...,
    hpdk: Dict[str, Any] = ...,
    lightkv: Dict[str, Any] = ...,
    hoakv: Dict[str, Any] = ...,
) -> Db:
    """Open (creating if missing) the store in directory ``path``.

    Keyword options mirror ``tierkv::Options``; each preset's own options are a dict named
    after the preset (``native={"shards": 8}``). Unknown options raise ``TypeError``.
    """

class RangeIterator(Iterator[_T]):
    """An iterator over a consistent snapshot of the store. Raises ``ClosedError`` once its
    Db is closed."""

    def __iter__(self) -> "RangeIterator[_T]": ...
    def __next__(self) -> _T: ...
    def close(self) -> None:
        """End the iteration now; later ``next()`` raises ``StopIteration``."""

class WriteBatch:
    """Puts and deletes applied atomically; a context manager that commits on a normal exit
    and discards the batch if the block raises."""

    def put(self, key: BytesLike, value: BytesLike) -> None: ...
    def delete(self, key: BytesLike) -> None: ...
    def __setitem__(self, key: BytesLike, value: BytesLike) -> None: ...
    def __delitem__(self, key: BytesLike) -> None: ...
    def __len__(self) -> int: ...
    def clear(self) -> None: ...
    def commit(self) -> None:
        """Apply the operations atomically (durable when it returns) and empty the batch."""
    def __enter__(self) -> "WriteBatch": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Snapshot:
    """A read-only, point-in-time view of the store."""

    def __getitem__(self, key: BytesLike) -> bytes: ...
    @overload
    def get(self, key: BytesLike) -> Optional[bytes]: ...
    @overload
    def get(self, key: BytesLike, default: _T) -> Union[bytes, _T]: ...
    def __contains__(self, key: object) -> bool: ...
    def __iter__(self) -> RangeIterator[bytes]: ...
    def items(
        self,
        start: Optional[BytesLike] = None,
        stop: Optional[BytesLike] = None,
        prefix: Optional[BytesLike] = None,
        reverse: bool = False,
    ) -> RangeIterator[Tuple[bytes, bytes]]: ...
    def keys(
        self,
        start: Optional[BytesLike] = None,
        stop: Optional[BytesLike] = None,
        prefix: Optional[BytesLike] = None,
        reverse: bool = False,
    ) -> RangeIterator[bytes]: ...
    def values(
        self,
        start: Optional[BytesLike] = None,
        stop: Optional[BytesLike] = None,
        prefix: Optional[BytesLike] = None,
        reverse: bool = False,
    ) -> RangeIterator[bytes]: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> "Snapshot": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Db:
    """An open tierkv store: a persistent, ordered mapping of bytes to bytes. Safe to share
    between threads; every store call releases the GIL."""

    def __getitem__(self, key: BytesLike) -> bytes: ...
    def __setitem__(self, key: BytesLike, value: BytesLike) -> None: ...
    def __delitem__(self, key: BytesLike) -> None:
        """Remove ``key``; removing an absent key is not an error."""
    def __contains__(self, key: object) -> bool: ...
    def __iter__(self) -> RangeIterator[bytes]: ...
    @overload
    def get(self, key: BytesLike) -> Optional[bytes]: ...
    @overload
    def get(self, key: BytesLike, default: _T) -> Union[bytes, _T]: ...
    def put(self, key: BytesLike, value: BytesLike) -> None: ...
    def delete(self, key: BytesLike) -> None: ...
    def insert_if_absent(self, key: BytesLike, value: BytesLike) -> bool: ...
    def update_if_present(self, key: BytesLike, value: BytesLike) -> bool: ...
    def write_batch(self) -> WriteBatch: ...
    def items(
        self,
        start: Optional[BytesLike] = None,
        stop: Optional[BytesLike] = None,
        prefix: Optional[BytesLike] = None,
        reverse: bool = False,
    ) -> RangeIterator[Tuple[bytes, bytes]]:
        """(key, value) pairs in key order; ``start`` inclusive, ``stop`` exclusive."""
    def keys(
        self,
        start: Optional[BytesLike] = None,
        stop: Optional[BytesLike] = None,
        prefix: Optional[BytesLike] = None,
        reverse: bool = False,
    ) -> RangeIterator[bytes]: ...
    def values(
        self,
        start: Optional[BytesLike] = None,
        stop: Optional[BytesLike] = None,
        prefix: Optional[BytesLike] = None,
        reverse: bool = False,
    ) -> RangeIterator[bytes]: ...
    def snapshot(self) -> Snapshot: ...
    def stats(self) -> Dict[str, Any]: ...
    def check(self) -> List[str]:
        """The problems found (empty when the store is sound)."""
    def compact(self) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def path(self) -> pathlib.Path: ...
    @property
    def preset(self) -> str: ...
    def __enter__(self) -> "Db": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
