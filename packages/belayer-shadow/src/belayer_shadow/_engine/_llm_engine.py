"""`LLMEngine`: requests in, one token per running request per `step()` out.

Not thread-safe: one thread (or one task) drives an engine.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from belayer_gpumem import KVClient, WeightClient
from belayer_shadow._engine._block_manager import BlockManager, num_blocks_for
from belayer_shadow._engine._config import ModelConfig
from belayer_shadow._engine._model import Qwen3Model, outside_region, torch_dtype
from belayer_shadow._engine._runner import ModelRunner
from belayer_shadow._engine._scheduler import Scheduler
from belayer_shadow._engine._sequence import SamplingParams, Sequence, StepOutput
from belayer_shadow._errors import LLMEngineError, RequestError, WeightsError

__all__ = ["LLMEngine", "allocate_kv_arena", "server_params"]


def server_params(client: WeightClient) -> dict[str, torch.Tensor]:
    """The weight server's views of the pinned version: the table and its merged projections."""
    return {**client.tensors(), **client.fused_tensors()}


def allocate_kv_arena(
    config: ModelConfig, num_blocks: int, block_size: int, *, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A private KV arena (zeros) shaped like the KV server's: for tests, benchmarks and no-server use."""
    shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return torch.zeros(shape, dtype=torch_dtype(config.dtype), device=device)


class LLMEngine:
    """A continuous-batching Qwen3 engine over weights and a paged KV arena it does not own.

    `params` maps `Qwen3ForCausalLM` state-dict names to tensors (views of the weight server's
    region, or a plain dict); `kv` is the arena (num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim), e.g. `KVClient.arena` or `allocate_kv_arena(...)`. Neither is copied.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Mapping[str, torch.Tensor],
        kv: torch.Tensor,
        *,
        device: str | torch.device = "cpu",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        expected = (config.num_hidden_layers, 2, config.num_key_value_heads, config.head_dim)
        if kv.dim() != 6 or (kv.shape[0], kv.shape[1], kv.shape[4], kv.shape[5]) != expected:
            raise LLMEngineError(
                f"KV arena of shape {tuple(kv.shape)} does not fit the model: want "
                f"(num_layers={expected[0]}, 2, num_blocks, block_size, {expected[2]}, {expected[3]})"
            )
        if kv.dtype != torch_dtype(config.dtype) or kv.device != self.device:
            raise LLMEngineError(
                f"KV arena is {kv.dtype} on {kv.device}; want {config.dtype} on {self.device}"
            )
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise LLMEngineError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.max_model_len = min(
            max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = Qwen3Model(config, params, self.device)
        self.runner = ModelRunner(self.model, kv)
        self.block_manager = BlockManager(num_blocks=int(kv.shape[2]), block_size=int(kv.shape[3]))
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs, max_num_batched_tokens, self.max_model_len
        )
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.weight_client: WeightClient | None = None
        self.kv_client: KVClient | None = None

    @classmethod
    def attach(
        cls, config: ModelConfig, weights_socket: str | Path, kv_socket: str | Path, **kwargs: Any
    ) -> LLMEngine:
        """An engine on the memory servers at these sockets: parameters and KV cache are views, zero copy.

        Keyword arguments go to `LLMEngine(...)`; the device is the regions' device.
        """
        weights = WeightClient.attach(weights_socket)
        try:
            kv = KVClient.attach(kv_socket)
        except BaseException:
            weights.detach()
            raise
        try:
            arena = kv.arena
            if weights.version < 1:
                raise WeightsError(
                    f"the weight server at {weights_socket} holds no weights yet; fill it first "
                    "(belayer_shadow.fill_weight_server)"
                )
            engine = cls(config, server_params(weights), arena, device=arena.device, **kwargs)
        except BaseException:
            weights.detach()
            kv.detach()
            raise
        engine.weight_client = weights
        engine.kv_client = kv
        return engine

    # Requests.

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; its context is prompt + `params.generated_token_ids`. Raises RequestError."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise RequestError(f"request {request_id!r} is already running; abort it or use a new id")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise RequestError("prompt_token_ids must not be empty")
        context = prompt + list(params.generated_token_ids)
        vocab = self.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in context):
            raise RequestError(f"token ids must be ints in [0, {vocab}) for this model")
        if len(context) >= self.max_model_len:
            raise RequestError(
                f"context of {len(context)} tokens leaves no room under max_model_len={self.max_model_len}"
            )
        if len(context) > self.max_num_batched_tokens:
            raise RequestError(
                f"context of {len(context)} tokens exceeds max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        final_len = min(len(context) + params.max_tokens, self.max_model_len)
        needed = num_blocks_for(final_len, self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise RequestError(
                f"request needs {needed} KV blocks but the pool has {self.block_manager.num_blocks}; "
                "lower max_tokens or give the KV server more blocks"
            )
        seq = Sequence(
            request_id=request_id,
            token_ids=context,
            num_prompt_tokens=len(prompt),
            params=params,
            seed=secrets.randbits(64) if params.seed is None else params.seed,
            arrival=next(self._arrivals),
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is not (or no longer) here."""
        self._requests.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        """How many times a running request lost its blocks and had to be recomputed."""
        return self.scheduler.num_preemptions

    # Stepping.

    def step(self) -> list[StepOutput]:
        """One scheduling iteration (a prefill or a decode): at most one new token per running request."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        with torch.inference_mode():
            token_ids, logprobs = self.runner.run(batch)
        outputs = self.scheduler.postprocess(batch, token_ids, logprobs)
        for out in outputs:
            if out.finish_reason is not None:
                del self._requests[out.request_id]
        return outputs

    def warmup(self, num_requests: int = 4) -> None:
        """Run a few short requests through prefill and decode on a private scratch arena.

        It pays for lazy allocations and first-call costs without touching the shared KV arena or
        this engine's requests, so a shadow can warm up while the main worker serves from the
        same memory.
        """
        block_size = self.block_manager.block_size
        num_tokens = 8 + 4
        num_blocks = num_requests * num_blocks_for(num_tokens, block_size)
        scratch = allocate_kv_arena(self.config, num_blocks, block_size, device=self.device)
        runner = ModelRunner(self.model, scratch)
        scheduler = Scheduler(
            BlockManager(num_blocks, block_size), num_requests, num_requests * 8, num_tokens
        )
        for i in range(num_requests):
            params = SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 1.0, seed=i)
            scheduler.add(
                Sequence(
                    request_id=f"warmup-{i}",
                    token_ids=[(i + j) % self.config.vocab_size for j in range(8)],
                    num_prompt_tokens=8,
                    params=params,
                    seed=i,
                    arrival=i,
                )
            )
        with torch.inference_mode():
            while (batch := scheduler.schedule()) is not None:
                token_ids, logprobs = runner.run(batch)
                scheduler.postprocess(batch, token_ids, logprobs)

    # Memory.

    def flush_kv(self) -> None:
        """Drop every cached block (and zero the KV server's arena, if attached): all requests re-prefill."""
        if self.kv_client is not None:
            self.kv_client.flush()
        self.scheduler.reset_kv()

    def refresh_weights(self) -> bool:
        """Re-read the weight views after a version bump at the weight server; True if they changed.

        Cached K/V of running requests stays as computed with the old weights; call `flush_kv()`
        too if those requests must continue on the new weights only.
        """
        if self.weight_client is None:
            return False
        changed = self.weight_client.refresh()
        if changed:
            self.model.bind(server_params(self.weight_client))
        return changed

    def private_weights(self) -> list[str]:
        """The weights the forward pass reads that are not views of the weight server's region
        (private copies); every one when the engine is not attached to a weight server."""
        weights = self.model.named_weights()
        if self.weight_client is None:
            return sorted(weights)
        return outside_region(weights, self.weight_client.region)

    def release_weights(self) -> None:
        """Unpin the weight version while the engine is idle (a standby shadow): weight updates then
        never wait for it.  Call `refresh_weights()` before the next step."""
        if self.weight_client is not None:
            self.weight_client.release()

    def bind_kv(self) -> None:
        """Nothing to do: this engine's KV cache is the arena it was built on."""

    def bind_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Use other parameter tensors from now on (zero copy), e.g. a new dict of weights."""
        self.model.bind(params)

    def close(self) -> None:
        """Detach from the memory servers (their memory stays for other clients)."""
        for client in (self.weight_client, self.kv_client):
            if client is not None:
                client.detach()
        self.weight_client = None
        self.kv_client = None
