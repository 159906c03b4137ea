"""The CLI contract without a cluster: usage errors are one line and exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "belayer_cluster", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_address_where_no_cluster_answers_is_a_usage_error() -> None:
    done = _run("status", "--address", f"127.0.0.1:{_free_port()}", "--connect-timeout-s", "5")
    assert done.returncode == 2
    assert done.stderr.startswith("belayer-cluster: error: no Ray cluster answers at 127.0.0.1:")
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""


def test_a_malformed_address_and_a_missing_flag_are_usage_errors() -> None:
    done = _run("status", "--address", "nohostport")
    assert done.returncode == 2
    assert (
        done.stderr.strip() == "belayer-cluster: error: the Ray address must be HOST:PORT (got 'nohostport')"
    )
    missing = _run("status")
    assert missing.returncode == 2
    assert missing.stderr.startswith(
        "belayer-cluster: error: the following arguments are required: --address"
    )


def test_debug_keeps_the_traceback() -> None:
    done = _run("--debug", "status", "--address", "nohostport")
    assert done.returncode != 0
    assert "Traceback" in done.stderr
    assert "ClusterConfigError" in done.stderr


def test_serve_takes_shadow_serves_flags_into_the_slots_options() -> None:
    """`belayer-cluster serve` parses belayer-shadow's shared serving flags (one definition,
    `add_serve_flags`): `--recovery`, `--block-size`, `--max-num-seqs`, `--hang-threshold-s` reach
    the options every slot host starts its slot with; `--resume-wait-s` and `--seed` the router's."""
    from belayer_cluster._cli import _parser
    from belayer_shadow import serve_config_from_flags

    args = _parser().parse_args(
        ["serve", "/models/m", "--slots", "2", "--recovery", "restart", "--block-size", "32",
         "--max-num-seqs", "8", "--hang-threshold-s", "9", "--resume-wait-s", "5", "--seed", "3",
         "--address", "10.0.0.1:6379"]
    )  # fmt: skip
    config = serve_config_from_flags(args)
    options = config.slot_options()
    assert (options["recovery"], options["block_size"], options["max_num_seqs"], options["stale_s"]) == (
        "restart", 32, 8, 9.0,
    )  # fmt: skip
    assert (config.num_slots, config.resume_wait_s, config.seed, args.address) == (2, 5.0, 3, "10.0.0.1:6379")


def test_serve_refuses_a_bad_serving_flag_before_joining_ray() -> None:
    done = _run("serve", "/nonexistent", "--block-size", "0", "--address", f"127.0.0.1:{_free_port()}")
    assert done.returncode == 2
    assert done.stderr.startswith("belayer-cluster: error: ")
    assert "block_size" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    bad_choice = _run("serve", "/nonexistent", "--recovery", "pray")
    assert bad_choice.returncode == 2
    assert "invalid choice: 'pray'" in bad_choice.stderr
