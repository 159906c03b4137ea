"""`VllmEngine`: a real vLLM engine behind the interface the workers drive (`LLMEngine`'s).

One process: vLLM's engine core and its executor run in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor), so killing the worker kills vLLM with
it and nothing is left behind. Parameters are views of the weight server (`_loader`); on the CPU
each linear layer computes with vLLM's packed copy of its view unless `packed=False` (`_loader`
says why and what it costs); with a KV socket the KV cache is laid on the KV server's arena
(`_kv`), else it is vLLM's own (`kv_cache_bytes` per process).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from belayer_gpumem import KVClient, WeightClient
from belayer_shadow._engine._config import ModelConfig
from belayer_shadow._engine._model import outside_region
from belayer_shadow._engine._sequence import SamplingParams, StepOutput
from belayer_shadow._errors import LLMEngineError, ModelConfigError, RequestError, WeightsError
from belayer_shadow._vllm._buffers import free_unused_buffers
from belayer_shadow._vllm._kv import VLLM_CPU_BLOCK_SIZE, arena_bytes, bind_arena, max_tokens_in
from belayer_shadow._vllm._loader import (
    LOAD_FORMAT,
    attached_client,
    copied_params,
    linear_kernels,
    packed_layers,
    point_params,
    register_loader,
    server_tensors,
)
from belayer_shadow._vllm._logprobs import install as install_sampled_logprobs
from belayer_shadow._vllm._media import set_aside_unloadable_media
from belayer_shadow._vllm._sampling import KEY_EXTRA, processor_name

__all__ = ["SUPPORTED_ARCHITECTURES", "VllmEngine", "model_folder"]

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
_WARMUP_PREFIX = "belayer-warmup-"
# vLLM 0.32's CPU attention (`CPUAttentionBackend.get_supported_head_sizes`); other sizes fail at
# the first forward pass, so they are refused at start.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def model_folder(config: ModelConfig, model: Path | None, scratch: Path) -> Path:
    """A Hugging Face model folder vLLM can read for `config` (no weights: those are the server's).

    `model` (an HF folder or a `config.json`) is checked first: another architecture is a
    ModelConfigError here, at start, not at the first request.
    """
    if model is not None:
        path = model / "config.json" if model.is_dir() else model
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelConfigError(f"cannot read the model config {str(path)!r}: {exc}") from exc
        architectures = data.get("architectures") or ["Qwen3ForCausalLM"]
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported:
            raise ModelConfigError(
                f"architecture {unsupported[0]} is not supported by belayer-shadow's vLLM worker; "
                f"use one of {list(SUPPORTED_ARCHITECTURES)}"
            )
    if config.head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ModelConfigError(
            f"head_dim={config.head_dim} is not supported by vLLM's CPU attention; "
            f"use one of {list(VLLM_CPU_HEAD_DIMS)} (or the built-in engine)"
        )
    hf = config.to_hf().to_dict()
    hf["architectures"] = list(SUPPORTED_ARCHITECTURES)
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "config.json").write_text(json.dumps(hf))
    return scratch


class VllmEngine:
    """vLLM's v1 `LLMEngine`, in process, on the weight server; the workers' engine interface.

    `add_request`, `step() -> list[StepOutput]`, `abort`, `has_unfinished`, `warmup`, `flush_kv`
    (vLLM's prefix cache), `refresh_weights`, `release_weights`, `close`, as `LLMEngine`. Each
    token's logprob is log_softmax of the raw logits at the sampled token, gathered alone
    (`_logprobs`; `sampled_logprobs_only` says it is installed).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights_socket: str | Path,
        *,
        model: Path | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        kv_cache_bytes: int = 512 * 1024 * 1024,
        num_threads: int = 1,
        kv_socket: str | Path | None = None,
        packed: bool = True,
    ) -> None:
        self.config = config
        # On the CPU: linear layers compute with vLLM's packed copies of the views (re-made at
        # each weight update) when True, on the views themselves (F.linear, zero copy) when False.
        self.packed = packed
        self.device = torch.device("cpu")
        self.max_model_len = min(
            max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        # With `kv_socket`, vLLM's KV cache lives in the KV server's arena (`_kv`): vLLM sizes its
        # cache to the arena, starts on a buffer of its own, and moves onto the arena at the first
        # request or when it stands by (`release_weights`); the context is bounded by the arena.
        self.kv_client: KVClient | None = None
        self.kv_bound = False
        if kv_socket is not None:
            self.kv_client = KVClient.attach(kv_socket)
            kv_cache_bytes = arena_bytes(self.kv_client.arena).numel()
            fits = max_tokens_in(config, kv_cache_bytes)
            if fits < 2 * VLLM_CPU_BLOCK_SIZE:
                self.kv_client.detach()
                raise LLMEngineError(
                    f"the KV server's arena ({kv_cache_bytes} bytes) holds {fits} positions of vLLM's "
                    f"KV cache; vLLM needs blocks of {VLLM_CPU_BLOCK_SIZE}: give the slot more KV blocks"
                )
            self.max_model_len = min(self.max_model_len, fits)
        self._scratch = tempfile.TemporaryDirectory(prefix="belayer-vllm-")
        folder = model_folder(config, model, Path(self._scratch.name))
        self._socket = str(weights_socket)
        self.weight_client: WeightClient | None = None
        self._requests: dict[str, int] = {}  # request id -> completion tokens emitted so far
        self._num_threads = num_threads
        self._threads = threading.local()
        # True while a standby shadow's layers compute on the views without their packed copies.
        self.standby_unpacked = False
        self._engine = _start_engine(
            folder,
            self._socket,
            dtype=config.dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            num_threads=num_threads,
            packed=packed,
        )
        # vLLM read the folder at start; removed now, so that a killed worker leaves no temp dir.
        self._scratch.cleanup()
        # vLLM's multimodal/prompt-embedding input buffer, which a text model never uses (`_buffers`).
        self.freed_buffer_bytes = int(sum(self._engine.collective_rpc(free_unused_buffers)))
        # Logprobs of the sampled tokens only (`_logprobs`): no top-k gather per step.
        (self.sampled_logprobs_only,) = self._engine.collective_rpc(install_sampled_logprobs)
        self.weight_client = attached_client(self._socket)
        # Parameters vLLM holds as private copies (fused parts not back to back at the server).
        self.copied_params = copied_params()

    # Requests.

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; its context is prompt + `params.generated_token_ids`. Raises RequestError."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if not request_id.startswith(_WARMUP_PREFIX):
            self.bind_kv()
        if request_id in self._requests:
            raise RequestError(f"request {request_id!r} is already running; abort it or use a new id")
        context = list(prompt_token_ids) + list(params.generated_token_ids)
        vocab = self.config.vocab_size
        if not prompt_token_ids:
            raise RequestError("prompt_token_ids must not be empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in context):
            raise RequestError(f"token ids must be ints in [0, {vocab}) for this model")
        if len(context) >= self.max_model_len:
            raise RequestError(
                f"context of {len(context)} tokens leaves no room under max_model_len={self.max_model_len}"
            )
        offset = len(params.generated_token_ids)
        extra: dict[str, Any] = {}
        temperature = params.temperature
        if params.temperature > 0 and params.seed is not None:
            # Keyed draws (see _sampling): the token at index i depends only on (seed, i).
            extra[KEY_EXTRA] = {
                "seed": params.seed,
                "offset": offset,
                "temperature": params.temperature,
                "top_p": params.top_p,
            }
        sampling = VllmSamplingParams(
            n=1,
            max_tokens=min(params.max_tokens, self.max_model_len - len(context)),
            temperature=temperature,
            top_p=params.top_p if not extra else 1.0,
            seed=params.seed if not extra else None,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
        )
        try:
            self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=context), sampling)
        except ValueError as exc:
            raise RequestError(f"vLLM refused request {request_id!r}: {exc}") from exc
        self._requests[request_id] = offset

    def abort(self, request_id: str) -> bool:
        """Drop a request; False if it is not (or no longer) here."""
        if self._requests.pop(request_id, None) is None:
            return False
        self._engine.abort_request([request_id])
        return True

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._requests)

    def step(self) -> list[StepOutput]:
        """One vLLM engine step: at most one new token per running request."""
        if not getattr(self._threads, "ready", False):
            # OpenMP's thread count is per calling thread, and vLLM's CPU attention checks that
            # the count it planned with is the one it runs with: set it in every stepping thread.
            torch.set_num_threads(self._num_threads)
            self._threads.ready = True
        outputs: list[StepOutput] = []
        for result in self._engine.step():
            index = self._requests.get(result.request_id)
            if index is None:
                continue
            completion = result.outputs[0]
            logprobs = completion.logprobs or []
            tokens = list(completion.token_ids)
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                finish = _finish_reason(completion.finish_reason) if last and result.finished else None
                entry = logprobs[i].get(token) if i < len(logprobs) else None
                logprob = float(entry.logprob) if entry is not None else float("nan")
                outputs.append(StepOutput(result.request_id, index, int(token), logprob, finish))
                index += 1
            if result.finished:
                del self._requests[result.request_id]
            else:
                self._requests[result.request_id] = index
        return outputs

    def warmup(self, num_requests: int = 4) -> None:
        """A few short requests through prefill and decode (vLLM's own KV cache; this engine's
        requests must be none)."""
        if self._requests:
            raise LLMEngineError("warmup needs an idle engine")
        for i in range(num_requests):
            params = SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 1.0, seed=i)
            self.add_request(
                f"{_WARMUP_PREFIX}{i}", [(i + j) % self.config.vocab_size for j in range(8)], params
            )
        while self.has_unfinished():
            self.step()
        self.flush_kv()

    # Memory.

    def flush_kv(self) -> None:
        """Drop vLLM's cached prefixes (running requests keep their blocks)."""
        self._engine.reset_prefix_cache()

    def refresh_weights(self) -> bool:
        """After a weight update at the server: point vLLM's parameters at the new version and drop
        the prefix cache (its K/V came from the old weights); True if the version changed.

        After `release_weights` (a standby shadow) it also packs the linear layers again (on the
        CPU with `packed`): the shadow's handover pays for that here, in its flush step."""
        if self.weight_client is None:
            return False
        changed = self.weight_client.refresh()
        if changed or self.standby_unpacked:
            tensors = server_tensors(self.weight_client)
            self._engine.apply_model(lambda model: point_params(model, tensors, packed=self.packed))
            self.standby_unpacked = False
        if changed:
            self._engine.reset_prefix_cache()
        return changed

    def release_weights(self) -> None:
        """Stand by: unpin the weight version while idle (a standby shadow); `refresh_weights()`
        pins again.

        What a standby shadow needs no longer goes too: its KV cache moves onto the arena (its own
        buffer is freed), and on the CPU its linear layers drop their packed copies (the CPU twin
        of releasing graph buffers while idle: until `refresh_weights`, the layers compute on the
        views, zero copy)."""
        self.bind_kv()
        if self.weight_client is not None:
            if self.packed and self.packed_layers():
                tensors = server_tensors(self.weight_client)
                self._engine.apply_model(lambda model: point_params(model, tensors, packed=False))
                self.standby_unpacked = True
            self.weight_client.release()

    def private_weights(self) -> list[str]:
        """vLLM's parameters whose bytes are not all inside the weight server's region (private
        copies of a weight); every one when the engine is detached."""
        if self.weight_client is None:
            (names,) = self._engine.apply_model(lambda model: sorted(n for n, _ in model.named_parameters()))
            return list(names)
        region = self.weight_client.region

        def outside(model: torch.nn.Module) -> list[str]:
            return outside_region(dict(model.named_parameters(remove_duplicate=False)), region)

        (names,) = self._engine.apply_model(outside)
        return list(names)

    def bind_kv(self) -> None:
        """Move vLLM's KV cache onto the KV server's arena (once; nothing without a KV socket).

        Before this, vLLM computes on a buffer of its own (a shadow's warm-up must not write the
        arena the main worker serves from); after it, vLLM holds no KV memory of its own."""
        if self.kv_client is None or self.kv_bound or self._engine is None:
            return
        if self._requests:
            raise LLMEngineError("bind_kv needs an idle engine (its requests' KV would be lost)")
        self._engine.reset_prefix_cache()
        arena = self.kv_client.arena
        self._engine.collective_rpc(lambda worker: bind_arena(worker.model_runner, arena))
        self.kv_bound = True

    def packed_layers(self) -> list[str]:
        """The linear layers computing with a packed copy of their weight (empty with `packed=False`
        or on a GPU); their parameters stay views of the weight server."""
        (names,) = self._engine.apply_model(packed_layers)
        return list(names)

    def linear_kernels(self) -> dict[str, str]:
        """The kernel each linear layer computes with: "onednn" or "sgl" (a packed copy of its
        view) or "F.linear" (on the view: `packed=False`, a GPU, or a layer oneDNN could not pack)."""
        (kernels,) = self._engine.apply_model(linear_kernels)
        return dict(kernels)

    def kv_cache_pointers(self) -> list[int]:
        """The data pointers of vLLM's per-layer KV cache tensors (for checks)."""
        (pointers,) = self._engine.collective_rpc(
            lambda worker: [int(t.data_ptr()) for t in worker.model_runner.kv_caches]
        )
        return list(pointers)

    def close(self) -> None:
        """Shut vLLM down and detach from the weight server."""
        engine, self._engine = self._engine, None
        if engine is not None:
            shutdown = getattr(engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()
        if self.weight_client is not None:
            self.weight_client.detach()
            self.weight_client = None
        if self.kv_client is not None:
            self.kv_client.detach()
            self.kv_client = None
        self._scratch.cleanup()


def _finish_reason(reason: str | None) -> str:
    return "stop" if reason == "stop" else "length"


def _register_in_process() -> None:
    """Register the served architecture with vLLM as a class, not by name. vLLM inspects a model
    registered by name in a fresh `python -m vllm.model_executor.models.registry` process (unless
    its file cache under `VLLM_CACHE_ROOT` has it), and that process imports transformers with the
    unloadable media packages not set aside: on a fresh machine the start failed with "Model
    architectures ['Qwen3ForCausalLM'] failed to be inspected". A class is inspected here, where
    they are set aside (vLLM's public `ModelRegistry.register_model`)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    ModelRegistry.register_model("Qwen3ForCausalLM", Qwen3ForCausalLM)


def _start_engine(folder: Path, socket_path: str, *, num_threads: int, packed: bool, **kwargs: Any) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores; we set the threads
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    torch.set_num_threads(num_threads)
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a warning
    set_aside = set_aside_unloadable_media()  # CUDA builds of torchvision & co. beside a CPU torch
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine
    except ImportError as exc:
        raise LLMEngineError(
            f"the vLLM engine needs vLLM: pip install 'belayer-shadow[vllm]' ({exc})"
        ) from exc
    if set_aside:
        _register_in_process()
    register_loader()
    args = EngineArgs(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype=kwargs["dtype"],
        enforce_eager=True,
        load_format=LOAD_FORMAT,
        model_loader_extra_config={"weights_socket": socket_path, "packed": packed},
        max_num_seqs=kwargs["max_num_seqs"],
        max_num_batched_tokens=max(kwargs["max_num_batched_tokens"], kwargs["max_model_len"]),
        max_model_len=kwargs["max_model_len"],
        kv_cache_memory_bytes=kwargs["kv_cache_bytes"],
        distributed_executor_backend="uni",
        disable_log_stats=True,
        seed=0,
        logits_processors=[processor_name()],
    )
    try:
        return VllmLLMEngine.from_engine_args(args)
    except (WeightsError, ModelConfigError):
        raise
    except Exception as exc:  # vLLM raises many types at start; say what failed, typed
        raise LLMEngineError(f"vLLM could not start on {folder}: {type(exc).__name__}: {exc}") from exc
    finally:
        torch.set_num_threads = set_num_threads
