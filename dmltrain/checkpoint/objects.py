"""Checkpoints in object storage through fsspec: ``--run-dir s3://bucket/run``.

Layout under the URI::

    checkpoints/ckpt-000003-00000189.pt   # a whole object: an upload is all or nothing
    checkpoints/latest                    # the newest published checkpoint's name
    checkpoints/best                      # the best one's
    training_log.csv, config.yaml, ...    # the run's records

An object store has no rename. A checkpoint is published by writing the small ``latest``
object after the checkpoint's. A job killed during an upload leaves no object, or one
that ``latest`` does not name: ``latest`` always names a complete checkpoint.

Records are written in a local folder, ``runs/<scheme>/<bucket>/<path>``: an object
cannot take one more line. They are copied up with each checkpoint and when the job ends,
and a job on another machine takes them down first.

One job at a time holds a run: its rank 0 writes ``lock`` with a conditional write (one
that fails where the object exists) and renews it every minute; a job of another owner
is refused while the lock is renewed, and takes it over once it is not (its job died).

Credentials come from the implementation's usual environment (``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``...). A URI that holds a password is
refused, so a secret never reaches a log, config.yaml or an error line.
"""

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dmltrain.checkpoint.storage import (
    FORMAT_VERSION,
    FULL,
    PREFIX,
    CheckpointDir,
    WriteFailed,
    atomic_save,
    checkpoint_name,
    first_that_loads,
    load_file,
)
from dmltrain.errors import UserError, first_line

# the optional extra that installs each scheme's fsspec implementation
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(location: str | None) -> bool:
    """Whether ``location`` names an object store (``s3://...``), not a local path.
    ``file://`` names a local path."""
    return bool(location) and bool(_SCHEME.match(location or "")) and not is_file_uri(location)


def is_file_uri(location: str | None) -> bool:
    return bool(location) and (location or "").startswith("file://")


def local(location: str) -> str:
    """``file:///a/b`` as ``/a/b``; any other location as it is."""
    return location[len("file://") :] if is_file_uri(location) else location


def mirror(uri: str) -> Path:
    """The local folder of a remote run's records: ``runs/<scheme>/<bucket>/<path>``."""
    parts = urlsplit(uri)
    return Path("runs", parts.scheme, parts.netloc, *[p for p in parts.path.split("/") if p])


def filesystem(uri: str) -> tuple[Any, str]:
    """The fsspec file system of ``uri`` and the path in it (no trailing slash); a
    UserError, in one line, when no implementation is installed or the URI holds a
    password."""
    parts = urlsplit(uri)
    if parts.password:
        raise UserError(
            f"{parts.scheme}://{parts.hostname}/...: a URI must not hold a password; put "
            "the credentials in the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)"
        )
    extra = EXTRAS.get(parts.scheme, parts.scheme)
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise UserError(
            f"{parts.scheme}:// needs an fsspec implementation ({first_line(exc)}): "
            f"pip install 'dmltrain[{extra}]'"
        ) from None
    return fs, str(path).rstrip("/")


def unreachable(uri: str) -> str | None:
    """Why the store at ``uri`` cannot be used (no bucket, no credentials), or None."""
    fs, path = filesystem(uri)
    try:
        fs.invalidate_cache()
        fs.ls(path, detail=False)
    except FileNotFoundError:
        bucket = path.split("/", 1)[0]
        try:
            found = fs.exists(bucket)
        except Exception as exc:  # a store that cannot say: the first error stands
            return _cannot(uri, exc)
        if not found:
            return f"--run-dir {uri}: the bucket {bucket} does not exist; create it first"
    except Exception as exc:
        return _cannot(uri, exc)
    return None


def _cannot(uri: str, exc: BaseException) -> str:
    why = first_line(exc)
    if type(exc).__name__ == "NoCredentialsError" or "credentials" in why.lower():
        return (
            f"cannot reach {uri}: no credentials ({why}); set them in the environment "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
        )
    return f"cannot reach {uri}: {why}"


def read(location: str, scratch: Path) -> dict[str, Any]:
    """A checkpoint's state (``load_file``'s) at ``location``, a path or a URI; a remote
    one is downloaded into ``scratch`` first and its local copy removed once loaded (the
    loaded tensors keep the memory-mapped file)."""
    if not is_uri(location):
        return load_file(Path(local(location)))
    fs, path = filesystem(location)
    scratch.mkdir(parents=True, exist_ok=True)
    copy = scratch / f".{path.rsplit('/', 1)[-1]}.tmp-{os.getpid()}"
    try:
        fs.get_file(path, str(copy))
    except FileNotFoundError:
        copy.unlink(missing_ok=True)
        raise UserError(f"checkpoint {location} does not exist") from None
    except Exception as exc:
        copy.unlink(missing_ok=True)
        raise UserError(f"cannot read checkpoint {location}: {_cannot(location, exc)}") from None
    try:
        return load_file(copy)
    except UserError as exc:
        raise type(exc)(str(exc).replace(str(copy), location)) from None
    finally:
        copy.unlink(missing_ok=True)


class ObjectStore(CheckpointDir):
    """The ``CheckpointStore`` of a run in object storage: full checkpoints under
    ``uri``/checkpoints, published by the ``latest`` object, and the run's records
    (``records``, the local folder) copied beside them.

    A save writes the file in ``records``/checkpoints first (where a background save's copy
    goes too), then uploads it, writes the pointers and prunes."""

    def __init__(self, uri: str, keep_last: int, records: Path, asynchronous: bool = False):
        super().__init__(records / "checkpoints", keep_last, asynchronous)
        self.uri = uri.rstrip("/")
        self.fs, self.root = filesystem(f"{self.uri}/checkpoints")
        self.records, self.records_root = records, self.root.rsplit("/", 1)[0]
        self._sent: dict[str, tuple[float, int]] = {}  # each record's mtime and size sent

    def where(self) -> str:
        return f"{self.uri}/checkpoints"

    def shards_problem(self) -> str | None:
        return (
            f"sharded checkpoints cannot be written to {self.where()} (object storage): "
            "pass --checkpoint-format full (rank 0 gathers the whole model), or a "
            "--run-dir on a file system"
        )

    def _location(self, name: str) -> str:
        return f"{self.uri}/checkpoints/{name}"

    def names(self) -> list[str]:
        """The checkpoints' names, newest first (the run directory's check of an earlier
        run reads them too)."""
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [str(p).rsplit("/", 1)[-1] for p in found]
        picked = [n for n in names if n.startswith(PREFIX) and n.endswith(FULL)]
        return sorted(picked, reverse=True)

    def _pointer(self, which: str, warn: Callable[[str], None] | None = None) -> str | None:
        """The checkpoint the pointer ``which`` names; None where there is none, or where
        it is not one (said with ``warn``: the checkpoints are then found by name)."""
        try:
            name = json.loads(self.fs.cat_file(f"{self.root}/{which}"))["checkpoint"]
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            name = None
        if not (isinstance(name, str) and name.startswith(PREFIX) and name.endswith(FULL)):
            if warn is not None:
                warn(f"{self.root}/{which} names no checkpoint; going by the checkpoints' names")
            return None
        return name

    def holds(self, epoch: int, global_step: int, sharded: bool) -> bool:
        try:
            return not sharded and self.fs.exists(
                f"{self.root}/{checkpoint_name(epoch, global_step)}"
            )
        except Exception:  # asked after a failed upload: the store may be what failed
            return False

    def newest(self) -> str | None:
        name = self._pointer("latest")
        return None if name is None else self._location(name)

    def latest_valid(self, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
        """The checkpoint ``latest`` names, else (it does not load) the newest older one
        that does; with no ``latest`` yet (killed before the first was published), the
        newest object that loads. A store whose checkpoints all fail is a UserError."""
        kept = self.kept()  # an earlier job's on this machine, whose upload failed
        if kept and (self._pointer("latest") or "") < kept[0].name:
            try:
                self._send_kept(kept[0])
            except Exception as exc:
                raise UserError(f"cannot upload {kept[0]}: {_cannot(self.uri, exc)}") from None
            warn(f"{kept[0]}, kept here when its upload failed, is uploaded now")
        pointed, names = self._pointer("latest", warn), self.names()
        order = [n for n in names if pointed is None or n < pointed]
        if pointed is not None:
            order.insert(0, pointed)
        found = [self._location(name) for name in order]
        return first_that_loads(found, self.read, self.where(), warn)

    def read(self, location: str) -> dict[str, Any]:
        return read(location, self.directory)

    def _write(self, state: dict[str, Any], epoch: int, global_step: int, best: bool) -> Path:
        self._clean_stale()
        name = checkpoint_name(epoch, global_step)
        staged = self.directory / f".{name}.tmp-{os.getpid()}"
        atomic_save({"format_version": FORMAT_VERSION, **state}, staged)
        try:
            self._upload(staged, name, best)
        except Exception as exc:
            kept = self.directory / name  # until one reaches the store (``settle``)
            os.replace(staged, kept)
            for old in self.kept()[max(self.keep_last, 1) :]:
                old.unlink(missing_ok=True)
            raise WriteFailed(
                f"cannot upload checkpoint {self._location(name)} ({_cannot(self.uri, exc)}); "
                f"it is kept at {kept} until a checkpoint reaches the store; "
                f"{self._last_good()}"
            ) from None
        finally:
            staged.unlink(missing_ok=True)
        self._drop_kept(name)
        with contextlib.suppress(Exception):  # published already; the next save prunes again
            self._prune()
        self.keep_records(must=False)
        return Path(name)

    def _upload(self, file: Path, name: str, best: bool) -> None:
        """``file`` as checkpoint ``name``, then the pointers that publish it."""
        self.fs.put_file(str(file), f"{self.root}/{name}")
        self.fs.pipe_file(f"{self.root}/latest", json.dumps({"checkpoint": name}).encode())
        if best:
            self.fs.pipe_file(f"{self.root}/best", json.dumps({"checkpoint": name}).encode())

    def _last_good(self) -> str:
        try:
            pointed = self._pointer("latest")
        except Exception:  # the store is what failed
            return "the store did not say which checkpoint is its newest"
        if pointed is None:
            return "the store holds no checkpoint of this run yet"
        return f"the last good checkpoint is {self._location(pointed)}"

    def kept(self) -> list[Path]:
        """Checkpoints kept here after a failed upload, newest first."""
        return sorted(self.directory.glob(f"{PREFIX}*{FULL}"), reverse=True)

    def _send_kept(self, newest: Path) -> None:
        """The newest checkpoint kept here uploaded and published as ``latest``; the kept
        copies it makes old dropped."""
        self._upload(newest, newest.name, best=False)
        self._drop_kept(newest.name)

    def _drop_kept(self, uploaded: str) -> None:
        """The kept copies that checkpoint ``uploaded``, now in the store, makes old."""
        for kept in self.kept():
            if kept.name <= uploaded:
                kept.unlink(missing_ok=True)

    def _prune(self) -> None:
        """All but the newest ``keep_last`` published checkpoints (never the best) go."""
        if self.keep_last <= 0:
            return
        pointed, best = self._pointer("latest"), self._pointer("best")
        published = [n for n in self.names() if pointed is not None and n <= pointed]
        for name in published[self.keep_last :]:
            if name != best:
                self.fs.rm_file(f"{self.root}/{name}")

    def save_sharded(self, *args: Any, **kwargs: Any) -> str:
        raise UserError(
            "sharded checkpoints cannot go to object storage: pass --checkpoint-format full"
        )

    def read_shards(self, location: str, shards: dict[str, Any], index: Any) -> None:
        raise UserError(f"{location} is sharded: copy it to a file system to load it")

    def settle(self, main: bool = True, failed: bool = False) -> None:
        """As the job ends, rank 0: the newest checkpoint kept after a failed upload
        uploaded now, and the records copied; a failure raises."""
        if not main:
            return
        kept = self.kept()
        if kept:
            try:
                self._send_kept(kept[0])
            except Exception as exc:
                raise UserError(
                    f"checkpoint(s) {', '.join(p.name for p in kept)} could not be uploaded "
                    f"to {self.where()} ({_cannot(self.uri, exc)}) and are only in "
                    f"{self.directory} on {socket.gethostname()}; {self._last_good()}"
                ) from None
        self.keep_records(must=True)

    def keep_records(self, must: bool = True) -> None:
        """Copy the run's records (the local folder's files) that changed since the last
        copy to the store. A failure raises only when the copy ``must`` be made (as the
        job ends); after a checkpoint the next copy tries again."""
        try:
            for path in sorted(self.records.iterdir()):
                if not path.is_file() or path.name.startswith("."):
                    continue
                stat = path.stat()
                if self._sent.get(path.name) == (stat.st_mtime, stat.st_size):
                    continue
                self.fs.put_file(str(path), f"{self.records_root}/{path.name}")
                self._sent[path.name] = (stat.st_mtime, stat.st_size)
        except Exception as exc:
            if must:
                raise UserError(
                    f"the run's records could not be copied to {self.uri} "
                    f"({_cannot(self.uri, exc)}); they are in {self.records}"
                ) from None


def fetch_records(uri: str, records: Path, every: bool = False) -> str | None:
    """An earlier job's records, from the store into the local folder where it lacks them
    (a job on another machine goes on writing them), or ``every`` one (to read them); why
    they could not be, or None."""
    fs, path = filesystem(uri)
    try:
        fs.invalidate_cache(path)
        found = fs.ls(path, detail=True)
        for entry in found:
            name = str(entry["name"]).rsplit("/", 1)[-1]
            if entry.get("type") == "file" and (every or not (records / name).exists()):
                fs.get_file(str(entry["name"]), str(records / name))
    except FileNotFoundError:  # a new run
        return None
    except Exception as exc:
        return _cannot(uri, exc)
    return None


LOCK = "lock"  # RUN/lock: the job that holds the run, renewed every BEAT_SECONDS
BEAT_SECONDS = 60.0
STALE_SECONDS = 180.0  # a lock not renewed this long is an ended job's


class RunLock:
    """A run in object storage, held by one job (``owner``: the batch job's id, which a
    requeued job keeps, else host:pid). ``take`` says why it cannot be; ``release`` ends
    the hold (the lock object is deleted where it is still this owner's)."""

    def __init__(self, uri: str, owner: str) -> None:
        self.fs, root = filesystem(uri)
        self.path, self.uri, self.owner = f"{root}/{LOCK}", uri, owner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        host, pid = socket.gethostname(), os.getpid()
        return json.dumps(
            {"owner": self.owner, "host": host, "pid": pid, "beat": time.time()}
        ).encode()

    def _held(self) -> dict[str, Any] | None:
        """The lock's record; {} where it is not one (written torn, or by hand)."""
        try:
            record = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def take(self) -> str | None:
        """Hold the run, or say why not (another owner renews the lock)."""
        try:
            for _ in range(2):
                try:
                    self.fs.pipe_file(self.path, self._record(), mode="create")
                    break
                except FileExistsError:
                    held = self._held()
                    if held is None:  # released meanwhile
                        continue
                    why = self._in_use(held)
                    if why:
                        return why
                    self.fs.rm_file(self.path)  # an ended job's, or this job's before a requeue
            else:
                return f"--run-dir {self.uri} is being taken by another job at this moment"
        except Exception as exc:
            return _cannot(self.uri, exc)
        self._thread = threading.Thread(target=self._renew, name="dmltrain-lock", daemon=True)
        self._thread.start()
        return None

    def _in_use(self, held: dict[str, Any]) -> str | None:
        """Why ``held`` (another job's lock) stands, or None where it is stale."""
        if held.get("owner") == self.owner:
            return None
        beat = held.get("beat")
        age = time.time() - beat if isinstance(beat, (int, float)) else STALE_SECONDS
        gone = held.get("host") == socket.gethostname() and not _alive(held.get("pid"))
        if age >= STALE_SECONDS or gone:
            return None
        who = f"{held.get('owner')} on {held.get('host')}"
        return (
            f"--run-dir {self.uri} is in use by another job ({who}, which renewed its lock "
            f"{age:.0f} s ago); two jobs would overwrite each other's checkpoints: wait for "
            f"it to end, or pass another --run-dir (a lock not renewed for {STALE_SECONDS:.0f} "
            "s is taken over)"
        )

    def _renew(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            with contextlib.suppress(Exception):  # the store may be down: the next beat
                if (self._held() or {}).get("owner") == self.owner:
                    self.fs.pipe_file(self.path, self._record())

    def release(self) -> None:
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        with contextlib.suppress(Exception):  # not released: stale in STALE_SECONDS
            if (self._held() or {}).get("owner") == self.owner:
                self.fs.rm_file(self.path)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
