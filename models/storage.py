"""File access for checkpoints on local disk or Google Cloud Storage (``gs://``).

Local paths use the file system only (no cloud package); ``gs://bucket/prefix`` paths go
through a ``tensorstore`` key-value store (GCS driver). Either way a tensor is read by its
byte range from the safetensors header, so no shard is ever read (or mapped) whole and
each tensor lands in host memory once. Files are written with ``safetensors``.

Safetensors layout used for ranged reads (the published format): an 8-byte little-endian
header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}}``
(offsets relative to the end of the header), then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
from typing import Any

import ml_dtypes
import numpy as np
import safetensors.numpy
import tensorstore as ts

FLOAT_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file name inside the checkpoint, dtype string, shape and
    (for ranged reads) its absolute byte range in the file."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    byte_range: tuple[int, int] | None = None


class StorageError(OSError):
    """A checkpoint file could not be read or written."""


class Storage:
    """A checkpoint directory: read / write named files relative to one root."""

    url: str

    def describe(self, name: str) -> str:
        """The full location of ``name`` (for messages)."""
        return f"{self.url.rstrip('/')}/{name}"

    def exists(self, name: str) -> bool:
        """Whether the file ``name`` exists."""
        raise NotImplementedError

    def read_bytes(self, name: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of file ``name`` (the whole file by default)."""
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes) -> None:
        """Create or replace the file ``name`` with ``data``."""
        raise NotImplementedError

    def read_json(self, name: str) -> Any:
        """Parse the JSON file ``name``; errors name the file."""
        if not self.exists(name):
            raise FileNotFoundError(f"{self.describe(name)} does not exist.")
        try:
            return json.loads(self.read_bytes(name).decode("utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.describe(name)} is not valid JSON: {e}") from e

    def write_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as indented JSON to ``name``."""
        self.write_bytes(name, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))

    def write_safetensors(self, name: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        """Write one safetensors file from host arrays."""

        self.write_bytes(name, safetensors.numpy.save(tensors, metadata=metadata))

    def list_tensors(self, name: str) -> dict[str, TensorInfo]:
        """The tensors in safetensors file ``name`` (header only, no tensor data)."""
        head = self.read_bytes(name, 0, 8)
        if len(head) < 8:
            raise ValueError(f"{self.describe(name)} is too short to be a safetensors file.")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:  # the format's own limit; larger means a corrupt or foreign file
            raise ValueError(f"{self.describe(name)} is not a safetensors file (header length {n}).")
        try:
            header = json.loads(self.read_bytes(name, 8, 8 + n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.describe(name)} has a corrupt safetensors header: {e}") from e
        out = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            b, e = entry["data_offsets"]
            out[key] = TensorInfo(key, name, entry["dtype"], tuple(entry["shape"]), (8 + n + b, 8 + n + e))
        return out

    def read_tensor(self, info: TensorInfo) -> np.ndarray:
        """One tensor as a host numpy array (floating dtypes only)."""
        dtype = _numpy_dtype(info)
        start, stop = info.byte_range
        data = self.read_bytes(info.file, start, stop)
        if len(data) != stop - start:
            raise StorageError(f"{self.describe(info.file)}: short read of tensor {info.name!r}.")
        return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(info.shape)


def _numpy_dtype(info: TensorInfo):
    if info.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"tensor {info.name!r} in {info.file} has dtype {info.dtype}; only floating tensors "
            f"({sorted(FLOAT_DTYPES)}) can be loaded as weights (dequantize the checkpoint first)."
        )
    return FLOAT_DTYPES[info.dtype]


class LocalStorage(Storage):
    """A checkpoint directory on the local file system."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root).expanduser()
        self.url = str(self.root)

    def path(self, name: str) -> pathlib.Path:
        """The local path of ``name``."""
        return self.root / name

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def read_bytes(self, name, start=None, stop=None):
        try:
            with open(self.path(name), "rb") as f:
                f.seek(start or 0)
                return f.read() if stop is None else f.read(stop - (start or 0))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self.describe(name)} does not exist.") from e

    def write_bytes(self, name, data):
        self.root.mkdir(parents=True, exist_ok=True)
        self.path(name).write_bytes(data)

    def write_safetensors(self, name, tensors, metadata):
        self.root.mkdir(parents=True, exist_ok=True)
        safetensors.numpy.save_file(tensors, str(self.path(name)), metadata=metadata)

    def read_tensor(self, info):
        # Read straight into the result buffer: one copy of the tensor in host memory.
        # (safe_open(framework="numpy") cannot decode bfloat16, and framework="flax"
        # held 3-4 copies of each tensor at once in bench_import_memory.)
        dtype = np.dtype(_numpy_dtype(info)).newbyteorder("<")
        start, stop = info.byte_range
        out = np.empty(info.shape, dtype)
        with open(self.path(info.file), "rb") as f:
            f.seek(start)
            n = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if n != stop - start:
            raise StorageError(f"{self.describe(info.file)}: short read of tensor {info.name!r} "
                               f"({n} of {stop - start} bytes); the file is truncated.")
        return out


def parse_gcs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix may be "")."""
    if not url.startswith("gs://"):
        raise ValueError(f"{url!r} is not a gs:// URL.")
    rest = url[len("gs://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} has no bucket name; use gs://BUCKET/path/to/checkpoint.")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/") if prefix else ""


class KvStoreStorage(Storage):
    """A checkpoint directory behind a ``tensorstore`` key-value store (GCS, or any driver)."""

    def __init__(self, spec: dict, url: str):
        self.url = url
        self.spec = spec
        try:
            self._kv = ts.KvStore.open(spec).result()
        except Exception as e:  # tensorstore raises ValueError for every failure
            raise StorageError(f"cannot open {url}: {e}") from e

    def _fail(self, name, e):
        hint = ""
        if self.spec.get("driver") == "gcs":
            hint = (" Check network access and credentials (GOOGLE_APPLICATION_CREDENTIALS or "
                    "`gcloud auth application-default login`) and that the bucket exists.")
        return StorageError(f"cannot access {self.describe(name)}: {e}.{hint}")

    def _read(self, name, byte_range=None):
        try:
            return self._kv.read(name, byte_range=byte_range).result()
        except Exception as e:
            raise self._fail(name, e) from e

    def exists(self, name):
        return self._read(name, slice(0, 0)).state == "value"

    def read_bytes(self, name, start=None, stop=None):
        r = self._read(name, None if start is None and stop is None else slice(start, stop))
        if r.state != "value":
            raise FileNotFoundError(f"{self.describe(name)} does not exist.")
        return bytes(r.value)

    def write_bytes(self, name, data):
        try:
            self._kv.write(name, data).result()
        except Exception as e:
            raise self._fail(name, e) from e


def open_storage(path: str | os.PathLike, *, gcs_retries: int = 4) -> Storage:
    """Storage for a local directory or a ``gs://bucket/prefix`` URL."""
    s = os.fspath(path)
    if s.startswith("gs://"):
        bucket, prefix = parse_gcs_url(s)
        spec = {"driver": "gcs", "bucket": bucket, "path": prefix,
                "context": {"gcs_request_retries": {"max_retries": gcs_retries}}}
        return KvStoreStorage(spec, s)
    if "://" in s:
        raise ValueError(f"{s!r}: only local paths and gs:// URLs are supported.")
    return LocalStorage(s)
