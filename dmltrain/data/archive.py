"""A gridded archive read as channels: variables of (time, [level], *grid), from a zarr
group or from any xarray Dataset (netCDF, HDF5, zarr), over a period of its time steps.

Rows ``read(start, stop)`` are float32 ``(steps, channels, *grid)``: each variable gives a
channel a selected level (one if it has no level axis), in the order named; static fields
(no time axis) are channels of their own. The archive is opened in the process that reads
it, never before: open file handles must not cross a fork. ``dmltrain[climate]``.
"""

import functools
import glob
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dmltrain.errors import UserError

EXTRA = "pip install 'dmltrain[climate]'"
# The read unit of an archive whose time axis is not chunked (a contiguous netCDF
# variable): any range costs only its bytes, so only the calls' overhead counts
UNCHUNKED_STEPS = 24

Source = str | Callable[[], Any]


def _zarr() -> Any:
    try:
        import zarr
    except ImportError:
        raise UserError(f"reading a zarr store needs zarr: {EXTRA}") from None
    return zarr


def _xarray() -> Any:
    try:
        import xarray
    except ImportError:
        raise UserError(
            f"reading netCDF or HDF5, or a period by date, needs xarray: {EXTRA}"
        ) from None
    return xarray


def _is_zarr(source: Source) -> bool:
    import os

    return isinstance(source, str) and os.path.isdir(source) and not glob.has_magic(source)


class ChunkGone(UserError):
    """A chunk the store held when it was opened is gone (deleted while the run read it)."""


# zarr reads a missing chunk as its fill value; these keys are metadata, not chunks
_METADATA = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


def _strict(store: Any, path: str) -> Any:
    """``store``, whose chunks present at opening must stay: zarr would read a chunk
    deleted since (a scratch purge) as its fill value, and train on zeros. A chunk absent
    at opening is one zarr left unwritten (all fill value) and reads as such."""
    from zarr.core.sync import sync
    from zarr.storage import WrapperStore

    async def keys() -> set[str]:
        return {key async for key in store.list() if not key.endswith(_METADATA)}

    present = sync(keys())

    class Strict(WrapperStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            found = await self._store.get(key, prototype, byte_range)
            if found is None and key in present:
                raise ChunkGone(
                    f"{path}: its chunk {key} is gone since the run opened the store (deleted "
                    "while the run read it: a scratch purge?); restore the store and run the "
                    "same command: the checkpoints are intact"
                )
            return found

    return Strict(store)


class _Variable:
    """One variable of an opened archive: its dimension names and a reader of time ranges."""

    def __init__(self, dims: tuple[str, ...], shape: tuple[int, ...], chunk: int | None,
                 read: Callable[[slice, Any, np.ndarray], None]) -> None:  # fmt: skip
        self.dims, self.shape, self.chunk, self.read = dims, shape, chunk, read


def _zarr_dims(array: Any, time_dim: str, level_dim: str) -> tuple[str, ...]:
    """An array's dimension names: zarr 3's, or xarray's attribute in zarr 2; else time
    first, then a level axis if it has 4, then the grid."""
    names = getattr(array.metadata, "dimension_names", None) or array.attrs.get("_ARRAY_DIMENSIONS")
    if names and len(names) == array.ndim and all(names):
        return tuple(str(n) for n in names)
    rest = [f"dim_{i}" for i in range(array.ndim)]
    if array.ndim >= 4:
        return (time_dim, level_dim, *rest[2:])
    return (time_dim, *rest[1:]) if array.ndim == 3 else tuple(rest)


class _Opened:
    """An archive opened in this process: its variables and coordinates by name."""

    def __init__(self, source: Source, time_dim: str, level_dim: str, strict: bool) -> None:
        self.name = source if isinstance(source, str) else getattr(source, "__name__", "archive")
        self.name = str(self.name)
        self.time_dim, self.level_dim = time_dim, level_dim
        if _is_zarr(source):
            self._open_zarr(str(source), strict)
        else:
            self._open_xarray(source)

    def _open_zarr(self, path: str, strict: bool) -> None:
        zarr = _zarr()
        try:
            group = zarr.open_group(path, mode="r")
            if strict:
                group = zarr.open_group(store=_strict(group.store, path), mode="r")
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise UserError(f"{path} is not a zarr group that can be read: {exc}") from None
        self.names = list(group.array_keys())
        self._group = group

        def variable(name: str) -> _Variable:
            array = group[name]
            dims = _zarr_dims(array, self.time_dim, self.level_dim)
            chunk = array.chunks[0] if dims and dims[0] == self.time_dim else None

            def read(times: slice, levels: Any, out: np.ndarray) -> None:
                # decoded straight into the caller's rows: no array of its own to copy
                from zarr.core.buffer.cpu import NDBuffer

                into = NDBuffer.from_numpy_array(out)
                if levels is None:
                    array.get_basic_selection(times, out=into)
                else:
                    array.get_orthogonal_selection((times, levels), out=into)

            return _Variable(dims, tuple(array.shape), chunk, read)

        self._variable = variable

    def _open_xarray(self, source: Source) -> None:
        xr = _xarray()
        if callable(source):
            opener = source
        elif glob.has_magic(source):
            opener = functools.partial(_open_glob, xr, source)
        else:
            opener = functools.partial(xr.open_dataset, source)
        try:
            dataset = opener()
        except Exception as exc:  # xarray's backends, or the user's own function
            raise UserError(
                f"{self.name} cannot be opened as an archive: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(dataset, xr.Dataset):
            raise UserError(
                f"{self.name} returned a {type(dataset).__name__}, not an xarray.Dataset"
            )
        self.names = [str(n) for n in dataset.data_vars] + [str(n) for n in dataset.coords]
        self._dataset = dataset

        def variable(name: str) -> _Variable:
            data = dataset[name]
            dims = tuple(str(d) for d in data.dims)
            first = [d for d in (self.time_dim, self.level_dim) if d in dims]
            data = data.transpose(*first, ...)
            dims = tuple(str(d) for d in data.dims)
            chunk = None
            if dims and dims[0] == self.time_dim:
                chunk = data.encoding.get("preferred_chunks", {}).get(self.time_dim)
                chunk = chunk or (data.chunks[0][0] if data.chunks else None) or UNCHUNKED_STEPS

            def read(times: slice, levels: Any, out: np.ndarray) -> None:
                part = data.isel({self.time_dim: times}) if times != slice(None) else data
                if levels is not None:
                    part = part.isel({self.level_dim: levels})
                out[...] = part.values

            return _Variable(dims, tuple(data.shape), chunk, read)

        self._variable = variable

    def variable(self, name: str) -> _Variable:
        if name not in self.names:
            have = ", ".join(self.names)
            raise UserError(f"{self.name} has no variable {name} (it has {have})")
        return self._variable(name)

    def coordinate(self, name: str) -> Any:
        """The values of the coordinate ``name`` (times decoded), or None."""
        if hasattr(self, "_dataset"):
            return self._dataset[name].values if name in self._dataset.coords else None
        if name not in self.names:
            return None
        array = self._group[name]
        values = np.asarray(array[:])
        units = array.attrs.get("units", "")
        if name == self.time_dim and "since" in str(units):
            coding = _xarray().coding.times
            calendar = array.attrs.get("calendar", "standard")
            return coding.decode_cf_datetime(values, units, calendar)
        return values


class Archive:
    """``variables`` (and ``static`` fields) of ``source`` over ``period``, as channels.

    ``source``: a zarr group's path; a netCDF or HDF5 file, or a glob of them (read with
    xarray, ``open_mfdataset`` for a glob); or a function that returns an
    ``xarray.Dataset`` (``functools.partial(xr.open_zarr, url)``, picklable for the loader
    workers). ``levels``: values of the level coordinate (its indices where the archive has
    none). ``period``: ``(start, stop)`` time indices (stop excluded), or dates, both ends
    included as xarray's ``sel`` takes them (``("1979", "2015")``).
    """

    def __init__(
        self,
        source: Source,
        variables: str | Sequence[str],
        levels: Sequence[Any] | None = None,
        period: tuple[Any, Any] | None = None,
        static: Sequence[str] = (),
        time_dim: str = "time",
        level_dim: str = "level",
    ) -> None:
        if not (isinstance(source, str) or callable(source)):
            raise UserError(
                f"an archive is a path or a function that opens an xarray.Dataset, not a "
                f"{type(source).__name__}: pass functools.partial(xr.open_dataset, path), so "
                "that each loader worker opens its own"
            )
        self.source = str(source) if isinstance(source, str) else source
        self.variables = [variables] if isinstance(variables, str) else list(variables)
        self.static = list(static)
        self.time_dim, self.level_dim = time_dim, level_dim
        if not self.variables:
            raise UserError("an archive needs one variable at least")
        opened = _Opened(self.source, time_dim, level_dim, strict=False)  # metadata only
        self.name = opened.name
        found = [opened.variable(v) for v in self.variables]
        timeless = [
            v for v, f in zip(self.variables, found, strict=True) if f.dims[:1] != (time_dim,)
        ]
        if timeless:
            raise UserError(
                f"{self.name}: {', '.join(timeless)} has no time axis '{time_dim}' first "
                "(pass it as static, or name the time dimension with time_dim)"
            )
        self.level_index = self._levels(opened, found, levels)
        grids = {f.shape[1 + (level_dim in f.dims) :] for f in found}
        if len(grids) > 1:
            raise UserError(
                f"{self.name}: {', '.join(self.variables)} differ in grid ({sorted(grids)})"
            )
        self.grid: tuple[int, ...] = grids.pop()
        self.total = found[0].shape[0]
        if any(f.shape[0] != self.total for f in found):
            raise UserError(f"{self.name}: {', '.join(self.variables)} differ in time steps")
        self.chunk = max(f.chunk or 1 for f in found)
        self.start, self.stop = self._period(opened, period)
        self.channels = [
            name
            for v, f in zip(self.variables, found, strict=True)
            for name in self._channel_names(v, f, opened)
        ]
        for name in self.static:
            field = opened.variable(name)
            if time_dim in field.dims or field.shape != self.grid:
                raise UserError(
                    f"{self.name}: the static field {name} has shape {field.shape}; it must "
                    f"have the grid's {self.grid} and no time axis"
                )
        self._opened: _Opened | None = None

    # ----- metadata --------------------------------------------------------------------
    def _levels(self, opened: _Opened, found: list[_Variable], levels: Any) -> Any:
        if levels is None:
            return None
        if not any(self.level_dim in f.dims for f in found):
            raise UserError(f"{self.name}: no variable has a level axis '{self.level_dim}'")
        values = opened.coordinate(self.level_dim)
        if values is None:
            index = [int(v) for v in levels]
        else:
            where = {float(v): i for i, v in enumerate(values)}
            missing = [v for v in levels if float(v) not in where]
            if missing:
                have = ", ".join(f"{float(v):g}" for v in values)
                raise UserError(f"{self.name} has no level {missing[0]} (it has {have})")
            index = [where[float(v)] for v in levels]
        self._level_labels = list(levels)
        return index

    def _channel_names(self, variable: str, found: _Variable, opened: _Opened) -> list[str]:
        if self.level_dim not in found.dims:
            return [variable]
        if self.level_index is not None:
            labels = self._level_labels
        else:
            values = opened.coordinate(self.level_dim)
            count = found.shape[found.dims.index(self.level_dim)]
            labels = list(values) if values is not None else list(range(count))
        return [f"{variable}_{_label(v)}" for v in labels]

    def _period(self, opened: _Opened, period: Any) -> tuple[int, int]:
        if period is None:
            return 0, self.total
        start, stop = period
        if all(isinstance(x, (int, np.integer)) or x is None for x in period):
            first, last = start or 0, self.total if stop is None else stop
        else:
            times = opened.coordinate(self.time_dim)
            if times is None:
                raise UserError(
                    f"{self.name} has no time coordinate '{self.time_dim}': give the period "
                    "by time index, (start, stop)"
                )
            import pandas

            try:
                found = pandas.DatetimeIndex(times).slice_indexer(start, stop)
            except (ValueError, TypeError, KeyError) as exc:
                raise UserError(f"{self.name}: the period {period} cannot be read: {exc}") from None
            first, last = found.start or 0, self.total if found.stop is None else found.stop
        if not 0 <= first < last <= self.total:
            raise UserError(
                f"{self.name}: the period {period} holds no time step of its {self.total}"
            )
        return int(first), int(last)

    @property
    def steps(self) -> int:
        """Time steps in the period."""
        return self.stop - self.start

    # ----- reading, in the process that reads --------------------------------------------
    def _open(self) -> _Opened:
        if self._opened is None:
            self._opened = _Opened(self.source, self.time_dim, self.level_dim, strict=True)
        return self._opened

    def read(self, first: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """float32 ``(stop - first, channels, *grid)``: the period's steps first..stop-1,
        into ``out`` where given (its channels beyond the archive's are left as they are)."""
        opened = self._open()
        times = slice(self.start + first, self.start + stop)
        shape = (stop - first, len(self.channels), *self.grid)
        rows = np.empty(shape, np.float32) if out is None else out
        channel = 0
        for name in self.variables:
            variable = opened.variable(name)
            if self.level_dim in variable.dims:
                count = len(self.level_index) if self.level_index is not None else variable.shape[1]
                variable.read(times, self.level_index, rows[:, channel : channel + count])
                channel += count
            else:
                variable.read(times, None, rows[:, channel])
                channel += 1
        return rows

    def read_static(self) -> np.ndarray:
        """float32 ``(static fields, *grid)``."""
        opened = self._open()
        fields = np.empty((len(self.static), *self.grid), np.float32)
        for field, name in zip(fields, self.static, strict=True):
            opened.variable(name).read(slice(None), None, field)
        return fields

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_opened": None}  # reopened where it is read


def _open_glob(xr: Any, pattern: str) -> Any:
    if not glob.glob(pattern):
        raise FileNotFoundError(f"no file matches {pattern}")
    return xr.open_mfdataset(pattern, combine="by_coords")


def _label(value: Any) -> str:
    return f"{float(value):g}" if isinstance(value, (int, float, np.number)) else str(value)
