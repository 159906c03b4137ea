"""SkyRL's checkpoint-delta weight sync, the receiving side: a chain of XOR deltas, decoded.

SkyRL's trainer (``weight_sync_backend="delta"``, skyrl 0.4.0) publishes each new version ``N`` of
the weights as a folder ``SYNC_DIR/delta-0000000N/``: a ``manifest.json`` (``version``,
``base_version`` = N - 1, and per changed tensor its ``name``, ``dtype``, ``shape``,
``uncompressed_num_bytes``, ``compressed_num_bytes``, ``payload_file``, ``payload_key`` and a
``checksum`` of its new bytes, ``xxh3-128`` or ``sha256``) and payload files
(``*.safetensors`` holding one ``uint8`` tensor per changed tensor: the zstd-compressed XOR of
the tensor's bytes in version N and in version N - 1, in the checkpoint's own dtype). Version 0
is the base checkpoint (``base_model_path``); a tensor that did not change has no record.

`DeltaChain` keeps the last version fetched as a folder of safetensors (the base folder at 0)
and, to fetch version M, reads it, applies the deltas after it up to M one after the other, and
writes version M beside it. Everything is checked before anything is written: the manifests'
versions, every record against the tensor it patches (name, dtype, shape, byte count), the
payloads (present, ``uint8``, the length announced, a zstd frame that decodes to exactly the
tensor's size), and the checksum of every patched tensor; a failure leaves the chain where it
was. The weight servers are not touched here: `SlotWeights` loads a fetched version as it loads
any folder (checked against the served model, written everywhere, committed on all).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from belayer_shadow._engine._loader import load_safetensors, save_safetensors
from belayer_shadow._errors import WeightsError

__all__ = ["DeltaChain", "apply_delta", "delta_folder_name"]

MANIFEST = "manifest.json"
CHECKSUMS = ("xxh3-128", "sha256")


def delta_folder_name(version: int) -> str:
    """The folder SkyRL publishes version ``version`` under, inside its ``sync_dir``."""
    return f"delta-{version:08d}"


@attrs.frozen
class _Record:
    name: str
    dtype: str
    shape: tuple[int, ...]
    uncompressed_num_bytes: int
    compressed_num_bytes: int
    payload_file: str
    payload_key: str
    checksum: str
    checksum_algorithm: str


def _field(item: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = item.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WeightsError(f"{where}: field {name!r} must be a {kind.__name__}, got {value!r}")
    return value


def _read_manifest(folder: Path, version: int) -> tuple[list[_Record], set[str]]:
    path = folder / MANIFEST
    where = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightsError(f"no delta published for version {version}: {where} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WeightsError(f"cannot read {where}: {error}") from error
    if not isinstance(data, dict):
        raise WeightsError(f"{where}: a manifest is a JSON object")
    if _field(data, "version", int, where) != version:
        raise WeightsError(f"{where} is version {data['version']}, expected {version}")
    if _field(data, "base_version", int, where) != version - 1:
        raise WeightsError(
            f"{where} patches version {data['base_version']}, the last one fetched here is {version - 1}"
        )
    files = data.get("payload_files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise WeightsError(f"{where}: 'payload_files' must be a list of file names")
    for name in files:  # names inside this folder, never a path out of it
        if not name or name != Path(name).name or name in (".", ".."):
            raise WeightsError(f"{where}: payload file {name!r} is not a plain file name")
    tensors = data.get("tensors", [])
    if not isinstance(tensors, list):
        raise WeightsError(f"{where}: 'tensors' must be a list")
    records = []
    for item in tensors:
        if not isinstance(item, dict):
            raise WeightsError(f"{where}: each entry of 'tensors' is an object")
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightsError(f"{where}: {item.get('name')!r} has no valid 'shape'")
        checksum = item.get("checksum", item.get("sha256"))  # SkyRL reads old manifests' sha256
        algorithm = item.get("checksum_algorithm", "xxh3-128" if "checksum" in item else "sha256")
        record = _Record(
            name=_field(item, "name", str, where),
            dtype=_field(item, "dtype", str, where),
            shape=tuple(shape),
            uncompressed_num_bytes=_field(item, "uncompressed_num_bytes", int, where),
            compressed_num_bytes=_field(item, "compressed_num_bytes", int, where),
            payload_file=_field(item, "payload_file", str, where),
            payload_key=_field(item, "payload_key", str, where),
            checksum=_field({"checksum": checksum}, "checksum", str, where),
            checksum_algorithm=_field({"a": algorithm}, "a", str, where),
        )
        if record.payload_file not in files:
            raise WeightsError(
                f"{where}: {record.name!r} names payload file {record.payload_file!r}, not listed"
            )
        if record.checksum_algorithm not in CHECKSUMS:
            raise WeightsError(
                f"{where}: {record.name!r} has checksum algorithm {record.checksum_algorithm!r}; "
                f"known: {list(CHECKSUMS)}"
            )
        records.append(record)
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise WeightsError(f"{where}: a tensor has two records")
    return records, set(files)


def _checksum(data: torch.Tensor, algorithm: str) -> str:
    buffer = data.numpy().data
    if algorithm == "sha256":
        return hashlib.sha256(buffer).hexdigest()
    import xxhash

    return str(xxhash.xxh3_128(buffer).hexdigest())


def _decompress(data: bytes, size: int, where: str) -> bytes:
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as error:
        raise WeightsError(f"{where}: the payload is not a valid zstd frame ({error})") from error
    if len(out) != size:
        raise WeightsError(f"{where}: the payload decodes to {len(out)} bytes, the tensor has {size}")
    return out


def apply_delta(tensors: Mapping[str, torch.Tensor], folder: Path, version: int) -> dict[str, torch.Tensor]:
    """The tensors of ``version``: those of ``version - 1`` (``tensors``, left unchanged) patched by
    the delta published in ``folder``. Raises `WeightsError` saying what is wrong, if anything."""
    from safetensors import SafetensorError, safe_open

    records, files = _read_manifest(folder, version)
    handles: dict[str, Any] = {}
    keys: dict[str, set[str]] = {}
    out = dict(tensors)
    try:
        for file in sorted(files):
            try:
                handle: Any = safe_open(str(folder / file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise WeightsError(f"cannot read payload file {str(folder / file)!r}: {error}") from error
            handles[file], keys[file] = handle, set(handle.keys())
        for record in records:
            where = f"{folder / MANIFEST}: {record.name}"
            old = tensors.get(record.name)
            if old is None:
                raise WeightsError(f"{where}: no such tensor in version {version - 1}")
            dtype = str(old.dtype).removeprefix("torch.")
            if record.dtype != dtype or record.shape != tuple(old.shape):
                raise WeightsError(
                    f"{where} is {record.dtype} {list(record.shape)}, version {version - 1} has "
                    f"{dtype} {list(old.shape)}"
                )
            size = old.numel() * old.element_size()
            if record.uncompressed_num_bytes != size:
                raise WeightsError(
                    f"{where}: {record.uncompressed_num_bytes} bytes announced, the tensor has {size}"
                )
            handle = handles[record.payload_file]
            if record.payload_key not in keys[record.payload_file]:
                raise WeightsError(f"{where}: payload {record.payload_key!r} is not in {record.payload_file}")
            try:
                payload = handle.get_tensor(record.payload_key)
            except (SafetensorError, OSError) as error:  # a truncated file fails here
                raise WeightsError(f"{where}: cannot read its payload ({error})") from error
            if payload.dtype != torch.uint8 or payload.numel() != record.compressed_num_bytes:
                raise WeightsError(
                    f"{where}: the payload is {payload.dtype} of {payload.numel()} elements, expected "
                    f"uint8 of {record.compressed_num_bytes} bytes"
                )
            patch = torch.frombuffer(
                bytearray(_decompress(payload.numpy().tobytes(), size, where)), dtype=torch.uint8
            )
            new = torch.bitwise_xor(old.contiguous().reshape(-1).view(torch.uint8), patch)
            if _checksum(new, record.checksum_algorithm) != record.checksum:
                raise WeightsError(
                    f"{where}: checksum mismatch after the patch ({record.checksum_algorithm}): the "
                    f"delta is corrupt or was made against other weights than version {version - 1}"
                )
            out[record.name] = new.view(old.dtype).reshape(old.shape)
    finally:
        handles.clear()
    return out


@attrs.define
class DeltaChain:
    """The versions of one SkyRL delta chain fetched so far: the last one, as a folder.

    ``scratch``: where fetched versions are written (a folder of this service's). Thread-safe:
    `fetch` and `init` hold ``lock``; whoever reads ``folder`` (a load) holds it too.
    """

    scratch: Path
    base: Path | None = None
    version: int = 0
    folder: Path | None = None  # the weights of `version` (`base` at 0)
    lock: threading.RLock = attrs.field(factory=threading.RLock)

    def init(self, base: Path) -> None:
        """Start over at ``base`` (version 0); drop every version fetched before."""
        with self.lock:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch.mkdir(parents=True, exist_ok=True)
            self.base, self.version, self.folder = base, 0, base

    def fetch(
        self,
        target_version: int,
        sync_dir: str | None,
        uri: str | None,
        check: Callable[[Mapping[str, torch.Tensor], str], None],
    ) -> dict[str, Any]:
        """Apply the deltas up to ``target_version`` (``sync_dir/delta-N``, the last one at ``uri``
        if given), ``check`` the result and keep it as the last version fetched. Raises
        `WeightsError` leaving the chain as it was."""
        with self.lock:
            if self.folder is None:
                raise WeightsError("no delta chain: call POST /init_weight_transfer_engine first")
            start = self.version
            if target_version == start:
                return {"version": start, "applied": 0}
            if target_version < start:
                raise WeightsError(
                    f"version {target_version} is behind the last one fetched ({start}); a new chain "
                    "starts with POST /init_weight_transfer_engine"
                )
            for location in (sync_dir, uri):
                if location is not None and "://" in location:
                    raise WeightsError(
                        f"{location!r}: only paths on this machine's file systems are read (shared "
                        "storage), not object stores"
                    )
            tensors = load_safetensors(self.folder)
            changed: set[str] = set()
            for version in range(start + 1, target_version + 1):
                if version == target_version and uri is not None:
                    folder = Path(uri)
                elif sync_dir is not None:
                    folder = Path(sync_dir) / delta_folder_name(version)
                else:
                    raise WeightsError(f"no sync_dir to find version {version} in (and no uri)")
                patched = apply_delta(tensors, folder, version)
                changed.update(name for name in patched if patched[name] is not tensors[name])
                tensors = patched
            check(tensors, f"delta version {target_version}")
            out = self.scratch / delta_folder_name(target_version)
            aside = self.scratch / f".{out.name}.new"
            shutil.rmtree(aside, ignore_errors=True)
            aside.mkdir(parents=True)
            save_safetensors(tensors, aside / "model.safetensors")
            shutil.rmtree(out, ignore_errors=True)
            aside.rename(out)
            if self.folder != self.base and self.folder != out:
                shutil.rmtree(self.folder, ignore_errors=True)
            self.version, self.folder = target_version, out
            return {
                "version": target_version,
                "applied": target_version - start,
                "changed_tensors": len(changed),
            }

    def ready(self, target_version: int) -> Path:
        """The folder of ``target_version``, fetched last; hold ``lock`` while reading it."""
        if self.folder is None:
            raise WeightsError("no delta chain: call POST /init_weight_transfer_engine first")
        if target_version != self.version:
            raise WeightsError(
                f"version {target_version} was not fetched (the last one fetched is {self.version}); "
                "POST /fetch_weights first"
            )
        return self.folder
