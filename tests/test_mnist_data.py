import gzip
import hashlib
import shutil

import numpy as np
import pytest
from helpers import SAMPLE

from dmltrain import UserError
from dmltrain_experiments import mnist_data

SAMPLE_MD5 = {
    "train-images-idx3-ubyte.gz": "c9ef0eaccfa7ebc068a225ea73f05d56",
    "train-labels-idx1-ubyte.gz": "de75012233083055db62c231c8bdc726",
    "t10k-images-idx3-ubyte.gz": "454281f5889a0363a2bedef0d8c18493",
    "t10k-labels-idx1-ubyte.gz": "02eea2151cfc106a3a91af161d681a26",
}


def test_bundled_sample_is_intact():
    for name, md5 in SAMPLE_MD5.items():
        assert hashlib.md5((SAMPLE / name).read_bytes()).hexdigest() == md5


def test_read_idx_gzipped_and_plain_agree(tmp_path):
    images = mnist_data.read_idx(SAMPLE / "train-images-idx3-ubyte.gz")
    labels = mnist_data.read_idx(SAMPLE / "train-labels-idx1-ubyte.gz")
    assert images.shape == (4000, 28, 28) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [400] * 10
    plain = tmp_path / "train-images-idx3-ubyte"
    plain.write_bytes(gzip.decompress((SAMPLE / "train-images-idx3-ubyte.gz").read_bytes()))
    assert np.array_equal(mnist_data.read_idx(plain), images)


def test_corrupt_files_give_clear_errors(tmp_path):
    raw = gzip.decompress((SAMPLE / "t10k-labels-idx1-ubyte.gz").read_bytes())
    truncated = tmp_path / "t10k-labels-idx1-ubyte"
    truncated.write_bytes(raw[:-10])
    with pytest.raises(UserError, match="truncated or corrupt"):
        mnist_data.read_idx(truncated)
    junk = tmp_path / "junk"
    junk.write_bytes(b"<html>not found</html>")
    with pytest.raises(UserError, match="bad magic number"):
        mnist_data.read_idx(junk)
    broken_gz = tmp_path / "x.gz"
    broken_gz.write_bytes(b"\x1f\x8b\x08garbage")
    with pytest.raises(UserError, match="cannot read MNIST file"):
        mnist_data.read_idx(broken_gz)


def _serve_sample(root):
    for name in SAMPLE_MD5:
        shutil.copy(SAMPLE / name, root / name)


def test_download_verifies_md5_and_renames_atomically(tmp_path, http_dir):
    served, url = http_dir
    _serve_sample(served)
    dest = tmp_path / "data"
    mnist_data.download(dest, [url], SAMPLE_MD5, timeout=10)
    assert sorted(p.name for p in dest.iterdir()) == sorted(SAMPLE_MD5)
    assert mnist_data.find_files(dest) is not None


def test_wrong_md5_leaves_no_file_and_next_mirror_is_tried(tmp_path, http_dir):
    served, url = http_dir
    (served / "bad").mkdir()
    (served / "good").mkdir()
    _serve_sample(served / "good")
    for name in SAMPLE_MD5:  # the bad mirror serves the wrong bytes under every name
        shutil.copy(SAMPLE / "t10k-labels-idx1-ubyte.gz", served / "bad" / name)
    dest = tmp_path / "data"
    with pytest.raises(OSError, match="MD5"):
        mnist_data.download(dest, [url + "bad/"], SAMPLE_MD5, timeout=10)
    assert list(dest.iterdir()) == []  # no partial or unverified file left behind
    mnist_data.download(dest, [url + "bad/", url + "good/"], SAMPLE_MD5, timeout=10)
    assert sorted(p.name for p in dest.iterdir()) == sorted(SAMPLE_MD5)


def test_failed_download_falls_back_to_sample_with_warning(tmp_path, http_dir):
    served, url = http_dir
    _serve_sample(served)  # the sample's bytes do not match full MNIST's MD5s
    why = mnist_data.fetch(tmp_path / "data", [url], timeout=10)
    assert why is not None and "MD5" in why
    warnings = []
    train, test, source = mnist_data.load(tmp_path / "data", True, why, warnings.append)
    assert (len(train), len(test)) == (4000, 1000)
    assert source == str(mnist_data.SAMPLE_DIR)
    assert len(warnings) == 1 and "bundled 5,000-digit sample" in warnings[0]
    assert "MD5" in warnings[0] and "\n" not in warnings[0]
    assert list((tmp_path / "data").iterdir()) == []
    with pytest.raises(UserError, match="full MNIST is not in"):
        mnist_data.load(tmp_path / "data", False, why, None)


def test_files_in_data_dir_are_used_without_download(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in SAMPLE_MD5:
        (data / name.removesuffix(".gz")).write_bytes(gzip.decompress((SAMPLE / name).read_bytes()))
    assert mnist_data.fetch(data, ["http://127.0.0.1:9/"]) is None  # present: nothing fetched
    warnings = []
    train, _test, source = mnist_data.load(data, False, "unused", warnings.append)
    assert source == str(data) and len(train) == 4000
    x, _y = train.tensors
    assert x.shape == (4000, 1, 28, 28) and abs(x.mean().item()) < 0.2
    assert warnings == []


@pytest.mark.parametrize("others", ["missing", "valid"])
def test_a_corrupt_file_in_data_dir_is_named_then_the_sample_is_used(tmp_path, others):
    """Random bytes named train-images-idx3-ubyte: the warning names that file and why it
    was rejected, then training falls back to the sample (or, without the fallback, the
    same reason is the error)."""
    data = tmp_path / "data"
    data.mkdir()
    if others == "valid":
        for name in SAMPLE_MD5:
            if not name.startswith("train-images"):
                shutil.copy(SAMPLE / name, data / name)
    corrupt = data / "train-images-idx3-ubyte"
    corrupt.write_bytes(np.random.default_rng(0).integers(1, 255, 5000, np.uint8).tobytes())
    warnings = []
    train, _test, source = mnist_data.load(data, True, "downloading is off", warnings.append)
    assert source == str(mnist_data.SAMPLE_DIR) and len(train) == 4000
    (warning,) = warnings
    assert f"{corrupt} is not an IDX file (bad magic number)" in warning, warning
    assert ("t10k-images-idx3-ubyte(.gz) is missing" in warning) == (others == "missing")
    assert "bundled 5,000-digit sample" in warning and "\n" not in warning
    raw = gzip.decompress((SAMPLE / "train-images-idx3-ubyte.gz").read_bytes())
    corrupt.write_bytes(raw[:-100])  # the right header, 100 bytes short
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte is truncated or corrupt"):
        mnist_data.load(data, False, "downloading is off", None)
