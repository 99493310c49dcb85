"""MNIST from the standard IDX files: read, download (MD5-verified, atomic), or fall back.

Order: the files in ``data_dir`` (gzipped or not) -> download of full MNIST into
``data_dir`` -> the 5,000-digit sample bundled with this package (with a warning).
"""

import gzip
import hashlib
import os
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dmltrain.errors import UserError

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# MD5 of the gzipped files of full MNIST.
FULL_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
SAMPLE_DIR = Path(__file__).parent / "mnist_sample"
MEAN, STD = 0.1307, 0.3081
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (gzipped if its name ends in .gz) into an array."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as exc:
        raise UserError(
            f"cannot read MNIST file {path}: {exc}; delete it to download again"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise UserError(
            f"{path} is not an IDX file (bad magic number); delete it to download again"
        )
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = offset + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise UserError(
            f"{path} is truncated or corrupt ({len(raw)} bytes, header says {expected}); "
            "delete it to download again"
        )
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape)


def find_files(directory: Path) -> dict[str, Path] | None:
    """The four IDX files in ``directory`` (plain or .gz), or None if any is missing."""
    found = {}
    for key, name in FILES.items():
        candidates = [directory / name, directory / f"{name}.gz"]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None
        found[key] = path
    return found


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(directory: Path, mirrors: list[str], md5s: dict[str, str], timeout: float) -> None:
    """Fetch every file in ``md5s`` into ``directory``; raise OSError if any cannot be had.

    Each file is written to a temporary name in ``directory`` and renamed only after its
    MD5 matches, so an interrupted or corrupt download never looks like a valid file.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name, md5 in md5s.items():
        target = directory / name
        if target.is_file() and _md5(target) == md5:
            continue
        errors = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + name
            fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".part")
            tmp = Path(tmp_name)
            try:
                with (
                    os.fdopen(fd, "wb") as out,
                    urllib.request.urlopen(url, timeout=timeout) as src,
                ):
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                got = _md5(tmp)
                if got != md5:
                    errors.append(f"{url}: MD5 {got} != expected {md5}")
                    continue
                os.replace(tmp, target)
                break
            except OSError as exc:
                errors.append(f"{url}: {getattr(exc, 'reason', exc)}")
            finally:
                tmp.unlink(missing_ok=True)
        else:
            raise OSError(f"could not download {name} ({'; '.join(errors)})")


def _tensors(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    x = torch.from_numpy(images.astype(np.float32) / 255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def fetch(data_dir: Path, mirrors: list[str], timeout: float = 30.0) -> str | None:
    """Download full MNIST into ``data_dir`` unless its files are there; why not, or None."""
    if find_files(data_dir) is not None:
        return None
    try:
        download(data_dir, mirrors, FULL_MNIST_MD5, timeout)
    except OSError as exc:
        return str(exc)
    return None


def read_dir(directory: Path) -> tuple[dict[str, np.ndarray] | None, list[str]]:
    """The four arrays in ``directory``, or None and what is wrong: each missing file, and
    each file that is not valid IDX (with why: bad magic number, wrong size)."""
    arrays, problems = {}, []
    for key, name in FILES.items():
        path = next((p for p in (directory / name, directory / f"{name}.gz") if p.is_file()), None)
        if path is None:
            problems.append(f"{name}(.gz) is missing")
            continue
        try:
            arrays[key] = read_idx(path)
        except UserError as exc:
            problems.append(str(exc))
    for split in ("train", "test"):
        images, labels = arrays.get(f"{split}_images"), arrays.get(f"{split}_labels")
        if images is not None and labels is not None and len(images) != len(labels):
            problems.append(f"MNIST {split} images and labels in {directory} differ in length")
    return (None, problems) if problems else (arrays, [])


def load(
    data_dir: Path, sample_fallback: bool, why_missing: str, warn: Callable[[str], None] | None
) -> tuple[TensorDataset, TensorDataset, str]:
    """(train, test, source): the files in ``data_dir``, else the bundled sample."""
    arrays, problems = read_dir(data_dir)
    if arrays is None:
        if len(problems) == len(FILES) and all("missing" in p for p in problems):
            why = f"full MNIST is not in {data_dir} and {why_missing}"
        else:  # some files are there: say what is wrong with them
            why = f"MNIST in {data_dir} cannot be used ({'; '.join(problems)})"
        if not sample_fallback:
            raise UserError(
                f"{why}; put the four IDX files there or allow the download or the bundled sample"
            )
        if warn is not None:
            warn(
                f"{why}; training on the bundled 5,000-digit sample instead. For full MNIST "
                f"put the four IDX files in {data_dir} or rerun with network access."
            )
        arrays, problems = read_dir(SAMPLE_DIR)
        assert arrays is not None, f"bundled sample unusable: {problems}"
        data_dir = SAMPLE_DIR
    train = _tensors(arrays["train_images"], arrays["train_labels"])
    test = _tensors(arrays["test_images"], arrays["test_labels"])
    return train, test, str(data_dir)
