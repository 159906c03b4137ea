"""A checkpoint's manifest: its schema, its self-checksum, and the checks before anything trusts it.

Nothing read from manifest.json reaches a path or the engine unchecked: the ids must be safe and
name the very directories the manifest lies in, and every file key must be a relative path inside
the checkpoint.  Format 2 adds ``manifest_sha256`` over the other fields, so a bit flip in the
prefix or the LLM context reference is caught; format 1 manifests (0.2.5 and earlier) have none
and are still read.  Format 3 adds the checkpoint's kind (`CheckpointKind`), its runtime (``criu``:
CRIU images; ``fresh``: the image's stateless init started anew), the layer's metadata digest and,
for a reference, the checkpoint whose artifacts it shares; formats 1 and 2 read as ``full``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from ._errors import CheckpointCorruptError, InvalidIdError, UnknownManifestFormatError
from ._ids import validate_id

MANIFEST = "manifest.json"
LAYER = "layer.tar"
CRIU_DIR = "criu"
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
SELF_SHA256 = "manifest_sha256"
RUNTIME_CRIU = "criu"
RUNTIME_FRESH = "fresh"


class CheckpointKind(enum.StrEnum):
    """How a checkpoint holds the sandbox's state (its manifest's ``kind``).

    ``full``: the writable layer and CRIU images of every process.  ``fresh-runtime``: the layer
    only; the runtime was the image's stateless init, started fresh on restore.  ``reference``:
    nothing changed since an earlier checkpoint of the same sandbox, whose artifacts it shares
    (hard links: removing that checkpoint leaves them in place).
    """

    FULL = "full"
    FRESH_RUNTIME = "fresh-runtime"
    REFERENCE = "reference"


# Fields format 3 adds, with the value formats 1 and 2 read as.
_KIND_FIELDS: dict[str, tuple[type, str]] = {
    "kind": (str, CheckpointKind.FULL.value),
    "runtime": (str, RUNTIME_CRIU),
    "layer_digest": (str, ""),
    "artifacts_of": (str, ""),
}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS: dict[str, type] = {
    "checkpoint_id": str,
    "trajectory": str,
    "prefix": int,
    "context_ref": str,
    "image": str,
    "config": dict,
    "container_id": str,
    "created_ns": int,
    "timings_ms": dict,
    "files": dict,
}


@attrs.frozen
class FileRecord:
    """Size and checksum of one file of a checkpoint."""

    size: int
    sha256: str


@attrs.frozen
class Checkpoint:
    """A ready checkpoint: the manifest plus where it lies."""

    checkpoint_id: str
    trajectory: str
    prefix: int
    context_ref: str
    image: str
    config: dict[str, Any]
    container_id: str
    created_ns: int
    timings_ms: dict[str, float]
    files: dict[str, FileRecord]
    path: Path = attrs.field(eq=False)
    kind: str = attrs.field(default=CheckpointKind.FULL.value, kw_only=True)
    runtime: str = attrs.field(default=RUNTIME_CRIU, kw_only=True)
    layer_digest: str = attrs.field(default="", kw_only=True)
    artifacts_of: str = attrs.field(default="", kw_only=True)

    @property
    def total_bytes(self) -> int:
        """Bytes of the layer archive and CRIU images together."""
        return sum(f.size for f in self.files.values())

    def to_manifest(self) -> dict[str, Any]:
        """The JSON form written to manifest.json (current format, with its self-checksum)."""
        data = attrs.asdict(self, filter=lambda a, _v: a.name != "path")
        data["format"] = FORMAT
        data[SELF_SHA256] = _self_sha256(data)
        return data

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        """Read and check ``path/manifest.json``; anything wrong raises `CheckpointCorruptError`
        (`UnknownManifestFormatError` for a format this version cannot read)."""
        try:
            text = (path / MANIFEST).read_text()
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"checkpoint {path} has no manifest: it is partial; remove it with `belayer-envckpt gc`"
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise _malformed(path, f"unreadable: {exc}") from exc
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise _malformed(path, f"not JSON: {exc}") from exc
        return cls(path=path, **_checked(path, data))


def _self_sha256(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != SELF_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _malformed(path: Path, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path} has a malformed manifest ({why}); it cannot be restored and `gc` leaves it "
        "for you to inspect: restore an earlier checkpoint (`belayer-envckpt ls`) or remove it by hand"
    )


def _checked(path: Path, data: object) -> dict[str, Any]:
    """The manifest's fields as `Checkpoint` takes them, after every check."""
    if not isinstance(data, dict):
        raise _malformed(path, f"a JSON {type(data).__name__}, not an object")
    fmt = data.get("format")
    expected = set(_FIELDS) | {"format"} | ({SELF_SHA256} if fmt in (2, 3) else set())
    expected |= set(_KIND_FIELDS) if fmt == 3 else set()
    if fmt not in READABLE_FORMATS or set(data) - expected:
        raise UnknownManifestFormatError(
            f"checkpoint {path} has a manifest of format {fmt!r} with keys {sorted(set(data) - expected)} "
            f"this version cannot read (it reads formats {READABLE_FORMATS}); it was probably written by a "
            "newer belayer-envckpt: use that version. `gc` leaves it alone"
        )
    if fmt in (2, 3) and data.get(SELF_SHA256) != _self_sha256(data):
        raise _malformed(path, "its self-checksum does not match: a field was changed after it was written")
    fields: dict[str, Any] = {k: data.get(k) for k in _FIELDS}
    for key, kind in _FIELDS.items():
        value = fields[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _malformed(path, f"{key} is {value!r}, not a {kind.__name__}")
    if fields["prefix"] < 0:
        raise _malformed(path, f"prefix {fields['prefix']} is negative")
    try:
        validate_id(fields["checkpoint_id"], "checkpoint")
        validate_id(fields["trajectory"], "trajectory")
    except InvalidIdError as exc:
        raise _malformed(path, str(exc)) from exc
    if fields["checkpoint_id"] != path.name or fields["trajectory"] != path.parent.name:
        raise _malformed(
            path,
            f"it names checkpoint {fields['trajectory']}/{fields['checkpoint_id']} but lies in "
            f"{path.parent.name}/{path.name}",
        )
    for key, (kind, default) in _KIND_FIELDS.items():
        value = data.get(key, default) if fmt == 3 else default
        if not isinstance(value, kind):
            raise _malformed(path, f"{key} is {value!r}, not a {kind.__name__}")
        fields[key] = value
    _check_kind(path, fields)
    fields["files"] = {_checked_key(path, k): _checked_record(path, k, v) for k, v in fields["files"].items()}
    return fields


def _check_kind(path: Path, fields: dict[str, Any]) -> None:
    """The kind, runtime and artifact owner must agree with each other."""
    kinds = {k.value for k in CheckpointKind}
    if fields["kind"] not in kinds:
        raise _malformed(path, f"kind {fields['kind']!r} is not one of {sorted(kinds)}")
    if fields["runtime"] not in (RUNTIME_CRIU, RUNTIME_FRESH):
        raise _malformed(path, f"runtime {fields['runtime']!r} is not {RUNTIME_CRIU!r} or {RUNTIME_FRESH!r}")
    expected_runtime = {CheckpointKind.FULL: RUNTIME_CRIU, CheckpointKind.FRESH_RUNTIME: RUNTIME_FRESH}
    wanted = expected_runtime.get(CheckpointKind(fields["kind"]))
    if wanted is not None and fields["runtime"] != wanted:
        raise _malformed(path, f"a {fields['kind']} checkpoint with runtime {fields['runtime']!r}")
    if (fields["kind"] == CheckpointKind.REFERENCE) != bool(fields["artifacts_of"]):
        raise _malformed(
            path, "artifacts_of must name the shared checkpoint exactly when the kind is reference"
        )
    if fields["artifacts_of"]:
        try:
            validate_id(fields["artifacts_of"], "checkpoint")
        except InvalidIdError as exc:
            raise _malformed(path, str(exc)) from exc


def _checked_key(path: Path, key: str) -> str:
    parts = PurePosixPath(key).parts
    if (
        PurePosixPath(key).as_posix() != key
        or not parts
        or key.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or not (key == LAYER or (parts[0] == CRIU_DIR and len(parts) > 1))
    ):
        raise _malformed(path, f"file {key!r} is not a path inside the checkpoint's layer or CRIU images")
    return key


def _checked_record(path: Path, key: str, value: object) -> FileRecord:
    if (
        not isinstance(value, dict)
        or set(value) != {"size", "sha256"}
        or not isinstance(value["size"], int)
        or isinstance(value["size"], bool)
        or value["size"] < 0
        or not isinstance(value["sha256"], str)
        or not _SHA256.fullmatch(value["sha256"])
    ):
        raise _malformed(path, f"the record of {key!r} is {value!r}, not {{size, sha256}}")
    return FileRecord(value["size"], value["sha256"])
