"""SkyRL's checkpoint deltas decoded (`DeltaChain`, `apply_delta`) on real files: a chain of
versions comes out bit-exact (float32 and bfloat16, unchanged tensors without records, several
versions in one fetch, sha256 manifests), and every broken delta is refused saying why, leaving
the chain where it was (the last version fetched still loadable, the next good delta applies)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from delta_helpers import PAYLOAD, edit_manifest, publish_delta

from belayer_shadow import WeightsError, load_safetensors
from belayer_shadow._engine._loader import save_safetensors
from belayer_shadow._serve._delta import DeltaChain, apply_delta


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=generator),
        "layer.weight": torch.randn(16, 16, generator=generator).to(torch.bfloat16),
        "norm.weight": torch.ones(16),  # never changes: no record
    }


def _step(weights: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step: small changes to every tensor but the norm."""
    generator = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for name in ("embed.weight", "layer.weight"):
        noise = 1e-3 * torch.randn(weights[name].shape, generator=generator)
        out[name] = (weights[name].float() + noise).to(weights[name].dtype)
    return out


def _no_check(tensors: Mapping[str, torch.Tensor], source: str) -> None:
    pass


def _equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a
    )


@pytest.fixture
def chain(tmp_path: Path) -> tuple[DeltaChain, list[dict[str, torch.Tensor]], Path]:
    """A chain at its base (version 0) and versions 0..3 published under the sync folder."""
    versions = [_weights(0)]
    for step in range(1, 4):
        versions.append(_step(versions[-1], step))
    base = tmp_path / "base"
    base.mkdir()
    save_safetensors(versions[0], base / "model.safetensors")
    sync = tmp_path / "sync"
    for version in range(1, 4):
        publish_delta(sync, version, versions[version - 1], versions[version])
    deltas = DeltaChain(tmp_path / "scratch")
    deltas.init(base)
    return deltas, versions, sync


def test_a_chain_of_deltas_comes_out_bit_exact(chain: tuple[DeltaChain, list[Any], Path]) -> None:
    deltas, versions, sync = chain
    manifest = json.loads((sync / "delta-00000001" / "manifest.json").read_text())
    assert {r["name"] for r in manifest["tensors"]} == {"embed.weight", "layer.weight"}  # norm unchanged

    assert deltas.fetch(1, str(sync), None, _no_check)["applied"] == 1
    assert _equal(load_safetensors(deltas.ready(1)), versions[1])
    assert deltas.fetch(1, str(sync), None, _no_check) == {"version": 1, "applied": 0}  # fetched already
    answer = deltas.fetch(3, str(sync), None, _no_check)  # two versions in one fetch
    assert answer == {"version": 3, "applied": 2, "changed_tensors": 2}
    assert _equal(load_safetensors(deltas.ready(3)), versions[3])
    assert not (deltas.scratch / "delta-00000001").exists()  # only the last version is kept
    with pytest.raises(WeightsError, match="was not fetched"):
        deltas.ready(2)
    with pytest.raises(WeightsError, match="behind"):
        deltas.fetch(2, str(sync), None, _no_check)


def test_the_last_delta_may_come_from_its_own_uri_and_sha256_checksums_are_read(tmp_path: Path) -> None:
    old, new = _weights(0), _step(_weights(0), 1)
    base = tmp_path / "base"
    base.mkdir()
    save_safetensors(old, base / "model.safetensors")
    elsewhere = publish_delta(tmp_path / "elsewhere", 1, old, new, checksum_algorithm="sha256")
    deltas = DeltaChain(tmp_path / "scratch")
    deltas.init(base)
    deltas.fetch(1, None, str(elsewhere), _no_check)
    assert _equal(load_safetensors(deltas.ready(1)), new)
    with pytest.raises(WeightsError, match="no sync_dir"):
        deltas.fetch(2, None, None, _no_check)
    with pytest.raises(WeightsError, match="object stores"):
        deltas.fetch(2, "s3://bucket/sync", None, _no_check)


def _flip_payload_byte(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    payloads = load_file(str(folder / PAYLOAD))
    name = sorted(payloads)[0]
    tensor = payloads[name].clone()
    tensor[len(tensor) // 2] ^= 0x5A
    payloads[name] = tensor
    save_file(payloads, str(folder / PAYLOAD))


def _truncate_payload(folder: Path) -> None:
    data = (folder / PAYLOAD).read_bytes()
    (folder / PAYLOAD).write_bytes(data[: len(data) // 2])


def _set(field: str, value: Any, index: int = 0) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        edit_manifest(folder, lambda m: m["tensors"][index].__setitem__(field, value))

    return change


BROKEN: dict[str, tuple[Callable[[Path], object], str]] = {
    "flipped payload byte": (_flip_payload_byte, "zstd|checksum"),
    "truncated payload file": (_truncate_payload, "payload"),
    "no manifest": (lambda f: (f / "manifest.json").unlink(), "no delta published for version 1"),
    "manifest not JSON": (lambda f: (f / "manifest.json").write_text("{"), "cannot read"),
    "wrong version": (lambda f: edit_manifest(f, lambda m: m.__setitem__("version", 7)), "version 7"),
    "wrong base version": (
        lambda f: edit_manifest(f, lambda m: m.__setitem__("base_version", 4)),
        "patches version 4",
    ),
    "unknown tensor": (_set("name", "other.weight"), "no such tensor"),
    "other dtype": (_set("dtype", "float16"), "float16"),
    "other shape": (_set("shape", [32, 32]), r"\[32, 32\]"),
    "byte count": (_set("uncompressed_num_bytes", 12), "12 bytes announced"),
    "compressed length": (_set("compressed_num_bytes", 3), "3 bytes"),
    "payload key": (_set("payload_key", "nothing"), "not in"),
    "checksum": (_set("checksum", "0" * 32), "checksum mismatch"),
    "checksum algorithm": (_set("checksum_algorithm", "md5"), "md5"),
    "payload outside the folder": (
        lambda f: edit_manifest(f, lambda m: m.__setitem__("payload_files", ["../x.safetensors"])),
        "plain file name",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_delta_is_refused_and_the_chain_stays_where_it_was(
    case: str, chain: tuple[DeltaChain, list[Any], Path]
) -> None:
    deltas, versions, sync = chain
    breaks, why = BROKEN[case]
    breaks(sync / "delta-00000001")
    with pytest.raises(WeightsError, match=why):
        deltas.fetch(1, str(sync), None, _no_check)
    assert deltas.version == 0
    assert _equal(load_safetensors(deltas.ready(0)), versions[0])  # the base, untouched
    assert list(deltas.scratch.iterdir()) == []  # nothing written
    publish_delta(sync, 1, versions[0], versions[1])  # published again, whole: it applies
    deltas.fetch(1, str(sync), None, _no_check)
    assert _equal(load_safetensors(deltas.ready(1)), versions[1])


def test_a_delta_against_other_weights_fails_its_checksum(chain: tuple[DeltaChain, list[Any], Path]) -> None:
    deltas, versions, sync = chain
    publish_delta(sync, 1, _weights(5), versions[1])  # made against weights the chain never had
    with pytest.raises(WeightsError, match="checksum mismatch"):
        deltas.fetch(1, str(sync), None, _no_check)


def test_the_check_sees_the_whole_result_and_its_refusal_keeps_the_chain(
    chain: tuple[DeltaChain, list[Any], Path],
) -> None:
    deltas, versions, sync = chain
    seen: list[dict[str, torch.Tensor]] = []

    def refuse(tensors: Mapping[str, torch.Tensor], source: str) -> None:
        seen.append(dict(tensors))
        raise WeightsError(f"{source}: not the served model")

    with pytest.raises(WeightsError, match="delta version 2: not the served model"):
        deltas.fetch(2, str(sync), None, refuse)
    assert _equal(seen[0], versions[2])
    assert deltas.version == 0


def test_apply_delta_leaves_its_input_alone(tmp_path: Path) -> None:
    old, new = _weights(0), _step(_weights(0), 1)
    kept = {name: tensor.clone() for name, tensor in old.items()}
    out = apply_delta(old, publish_delta(tmp_path, 1, old, new), 1)
    assert _equal(out, new)
    assert _equal(old, kept)
    assert out["norm.weight"] is old["norm.weight"]  # no record: the same tensor


def test_without_init_nothing_is_fetched(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="init_weight_transfer_engine"):
        DeltaChain(tmp_path).fetch(1, str(tmp_path), None, _no_check)
