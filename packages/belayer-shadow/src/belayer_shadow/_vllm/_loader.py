"""A vLLM model loader whose parameters are views of belayer-gpumem's weight server.

Registered with vLLM's loader registry as `load_format="belayer"`; the weight server's socket
comes in `model_loader_extra_config={"weights_socket": PATH}`. vLLM fuses q/k/v into `qkv_proj`
and gate/up into `gate_up_proj`: the weight server holds those as merged regions of its layout
(`weight_layout`'s `fused_projections`: the parts back to back, read as one tensor), so each fused
parameter is the server's view of its merged region, zero copy. A table without merged regions
(e.g. read from a safetensors file) falls back to a view over parts that happen to lie back to
back, else to a private copy, which `copied_params` reports.

On the CPU, vLLM computes every linear layer (qkv, o, gate_up, down, LM head) with a packed copy
of its weight (oneDNN's blocked layout, `dispatch_cpu_unquantized_gemm`): a plain row-major
matmul on the view is 1.3-3x slower at decode batch sizes (the kernel re-packs the weight on
every call). The parameters always stay views of the server; with `packed=True` (the default of
`VllmEngine`) each linear layer computes with a packed copy made from its view, at load and again
at every weight update (memory: one copy of the linear weights per worker; time: see
`bench_vllm_repack.py`). With `packed=False` the layers compute on the views themselves through
`torch.nn.functional.linear`: zero copy, slower. On a GPU nothing is packed: the views are used.
Which kernel each layer computes with is recorded (`linear_kernels`): a layer oneDNN cannot pack
falls back to `F.linear` on its view and reads `UNPACKED` there, never as packed. The input
embedding, which vLLM's dispatch also packs but only ever looks up, gets no packed copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from belayer_gpumem import WeightClient
from belayer_shadow._engine._config import ModelConfig, parameter_shapes
from belayer_shadow._engine._model import stacked_view
from belayer_shadow._errors import WeightsError

__all__ = [
    "LOAD_FORMAT",
    "ONEDNN",
    "SGL",
    "UNPACKED",
    "attached_client",
    "copied_params",
    "linear_kernels",
    "packed_layers",
    "param_views",
    "point_params",
    "register_loader",
    "server_tensors",
]

LOAD_FORMAT = "belayer"

# The kernel a CPU linear layer computes with, recorded on the module by `point_params`: a packed
# copy of its weight through oneDNN (`ONEDNN`) or sgl-kernel (`SGL`, bf16/fp16 on AMX CPUs), or
# the plain row-major matmul on the view (`UNPACKED`: `packed=False`, a GPU, or a layer oneDNN
# could not pack).
ONEDNN = "onednn"
SGL = "sgl"
UNPACKED = "F.linear"
_KERNEL_ATTR = "belayer_cpu_kernel"

_log = logging.getLogger(__name__)

# The weight clients the loader attached in this process, by socket path: the engine that asked
# for the load takes its client from here (vLLM builds the loader itself, from a name).
_CLIENTS: dict[str, WeightClient] = {}

# Parameters the last load had to copy (not views of the server), for the engine to report.
_COPIED: list[str] = []

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def attached_client(weights_socket: str) -> WeightClient:
    """The weight client the loader attached for `weights_socket` in this process (once)."""
    client = _CLIENTS.pop(weights_socket, None)
    if client is None:
        raise WeightsError(f"no vLLM model was loaded from the weight server at {weights_socket}")
    return client


def server_tensors(client: WeightClient) -> dict[str, torch.Tensor]:
    """The weight server's views of the pinned version: its table and its merged regions."""
    return {**client.tensors(), **client.fused_tensors()}


def copied_params() -> list[str]:
    """The parameters the last load in this process could not make views of the server (copies)."""
    return list(_COPIED)


def _source(name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The server's view for one vLLM parameter name (fused names map to a stacked view)."""
    prefix, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.qkv_proj / weight
    module_prefix, _, module = prefix.rpartition(".")
    parts = _FUSED.get(module)
    if parts is not None and name in tensors:
        return tensors[name]  # the server's merged region
    if parts is None:
        if name == "lm_head.weight" and name not in tensors:
            name = "model.embed_tokens.weight"  # tied embeddings
        if name not in tensors:
            raise WeightsError(f"vLLM's model has a parameter {name!r} the weight server does not hold")
        return tensors[name]
    views = []
    for part in parts:
        key = f"{module_prefix}.{part}.{leaf}"
        if key not in tensors:
            raise WeightsError(f"vLLM's fused {name!r} needs {key!r}, which the weight server does not hold")
        views.append(tensors[key])
    stacked = stacked_view(views)
    if stacked is None:
        # The server's table does not hold the parts back to back (e.g. a table read from a
        # safetensors file, whose names are sorted): a private fused copy, made again on every
        # weight update. `weight_layout`'s table avoids it.
        return torch.cat(views)
    return stacked


# vLLM pads the vocabulary of its embedding and LM head to a multiple of 64 rows.
_VOCAB_PADDED = ("embed_tokens.weight", "lm_head.weight")


def _padded(view: torch.Tensor, rows: int) -> torch.Tensor:
    """`view` with zero rows up to `rows` (vLLM's padded vocabulary): a private copy, made again on
    each weight update; the view itself when no padding is needed."""
    if rows <= view.shape[0] or rows - view.shape[0] >= 64:
        return view  # no padding, or not padding: the shape check below reports it
    padded = view.new_zeros((rows, view.shape[1]))
    padded[: view.shape[0]] = view
    return padded


def param_views(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For every parameter of vLLM's model, the server's view it should be (shapes checked)."""
    views: dict[str, torch.Tensor] = {}
    # Every name, also of shared (tied) parameters, so that each module is re-pointed.
    for name, param in model.named_parameters(remove_duplicate=False):
        view = _source(name, tensors)
        if name.endswith(_VOCAB_PADDED) and param.dim() == 2 and view.dim() == 2:
            view = _padded(view, param.shape[0])
        views[name] = view
        if param.numel() and tuple(param.shape) != tuple(view.shape):
            raise WeightsError(
                f"{name}: vLLM expects shape {tuple(param.shape)}, the weight server holds "
                f"{tuple(view.shape)}; the model folder does not match the weight server"
            )
    return views


def _gemm_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules vLLM's CPU dispatch gave a `cpu_linear` kernel."""
    for name, module in model.named_modules():
        if hasattr(module, "cpu_linear"):
            yield name, module


def _linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules that compute a matmul with their weight: not an input embedding, which vLLM's
    CPU dispatch also gives a packed copy but which is only ever looked up (`F.embedding`)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    for name, module in _gemm_modules(model):
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            continue
        yield name, module


def point_params(model: nn.Module, tensors: Mapping[str, torch.Tensor], *, packed: bool = True) -> list[str]:
    """Make every parameter of `model` a view of `tensors` (the server's); returns the names that
    had to be copied instead (fused parts not back to back in the server's table).

    Each CPU linear layer then computes with a packed copy of its view (vLLM's own kernel choice)
    when `packed`, else on the view itself (`F.linear`). Also used for a weight update: the same
    modules re-pointed at the new version's views (and packed again).
    """
    views = param_views(model, tensors)
    regions = {t.untyped_storage().data_ptr() for t in tensors.values()}
    copied = sorted(n for n, v in views.items() if v.untyped_storage().data_ptr() not in regions)
    modules = dict(model.named_modules())
    for name, view in views.items():
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        # A fresh Parameter each time: vLLM's CPU path may have replaced the original with an
        # empty placeholder, and `.data =` on a tied parameter would move both names at once.
        setattr(module, leaf, nn.Parameter(view, requires_grad=False))
    for _, module in _gemm_modules(model):
        # The previous packed copy (held by the old `cpu_linear` closure) is dropped here; an
        # input embedding's (never used) is not made again.
        vars(module)["cpu_linear"] = F.linear
    for _, module in _linear_modules(model):
        kernel = UNPACKED
        if packed and module.weight.device.type == "cpu":
            kernel = _pack(module)
        vars(module)[_KERNEL_ATTR] = kernel
    return copied


def linear_kernels(model: nn.Module) -> dict[str, str]:
    """The kernel each linear layer of `model` computes with (`ONEDNN`, `SGL` or `UNPACKED`), as
    installed by the last `point_params`; a layer it did not reach reads `UNPACKED`."""
    return {name: str(vars(module).get(_KERNEL_ATTR, UNPACKED)) for name, module in _linear_modules(model)}


def packed_layers(model: nn.Module) -> list[str]:
    """The linear layers of `model` that compute with a packed copy (not `F.linear` on the view)."""
    return [name for name, kernel in linear_kernels(model).items() if kernel != UNPACKED]


def _pack(module: nn.Module) -> str:
    """Make `module` compute with a packed copy of its weight (the weight stays the view); returns
    the kernel installed, `UNPACKED` where no packed kernel takes the layer (said in the log).

    The choice follows vLLM's CPU dispatch: sgl-kernel for the small bf16/fp16 shapes it takes on
    AMX CPUs, else oneDNN; unlike vLLM's dispatch, the result is recorded (`linear_kernels`).
    """
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    param = module.weight
    assert isinstance(param, torch.Tensor)
    weight = param.detach()
    rows, cols = weight.shape
    bias = getattr(module, "bias", None)
    if bias is None and check_cpu_sgl_kernel(rows, cols, weight.dtype):
        sgl_weight = torch.ops._C.convert_weight_packed(weight)

        def sgl_linear(x: torch.Tensor, _weight: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
            return ops.weight_packed_linear_cpu(x, sgl_weight, rows, None)  # type: ignore[no-any-return]

        vars(module)["cpu_linear"] = sgl_linear
        return SGL
    if not getattr(ops, "_supports_onednn", False):
        _log.warning("vLLM has no oneDNN kernels here: linear layers compute on the views (F.linear)")
        return UNPACKED
    try:
        handler = ops.create_onednn_mm(weight.t(), 32)
    except RuntimeError as exc:
        _log.warning("oneDNN could not pack %s %s: it computes on the view (F.linear): %s", rows, cols, exc)
        return UNPACKED

    def onednn_linear(
        x: torch.Tensor, _weight: torch.Tensor, layer_bias: torch.Tensor | None
    ) -> torch.Tensor:
        return ops.onednn_mm(handler, x, layer_bias)  # type: ignore[no-any-return]

    vars(module)["cpu_linear"] = onednn_linear
    return ONEDNN


def _register() -> type[Any]:
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class BelayerWeightLoader(BaseModelLoader):  # type: ignore[misc]  # Any without vLLM's types
        """Parameters as views of the weight server named in `model_loader_extra_config`."""

        def _socket(self) -> str:
            extra = self.load_config.model_loader_extra_config or {}
            socket_path = extra.get("weights_socket")
            if not socket_path:
                raise WeightsError("load_format='belayer' needs model_loader_extra_config['weights_socket']")
            return str(socket_path)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the weights are in the weight server."""

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            socket_path = self._socket()
            client = _CLIENTS.get(socket_path)
            if client is None:
                client = WeightClient.attach(socket_path)
                _CLIENTS[socket_path] = client
            if client.version < 1:
                raise WeightsError(
                    f"the weight server at {socket_path} holds no weights yet; fill it first "
                    "(belayer_shadow.fill_weight_server)"
                )
            check_table(model_config.hf_config, client)
            # Plain copies for vLLM's own processing; `load_model` points them at the server after.
            for name, view in param_views(model, server_tensors(client)).items():
                param = model.get_parameter(name)
                with torch.no_grad():
                    param.copy_(view)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            model: nn.Module = super().load_model(vllm_config, model_config, prefix)
            extra = self.load_config.model_loader_extra_config or {}
            packed = bool(extra.get("packed", True))
            _COPIED[:] = point_params(model, server_tensors(_CLIENTS[self._socket()]), packed=packed)
            return model

    register_model_loader(LOAD_FORMAT)(BelayerWeightLoader)
    return BelayerWeightLoader


_REGISTERED: list[type[Any]] = []


def register_loader() -> None:
    """Register the loader with vLLM (idempotent)."""
    if not _REGISTERED:
        _REGISTERED.append(_register())


def check_table(hf_config: Any, client: WeightClient) -> None:
    """Raise WeightsError unless the weight server's table is exactly the model's parameters."""
    config = ModelConfig.from_hf(hf_config)
    expected = parameter_shapes(config)
    table = {name: spec.shape for name, spec in client.layout.by_name.items()}
    if table != expected:
        missing = sorted(set(expected) - set(table))[:3]
        extra = sorted(set(table) - set(expected))[:3]
        wrong = sorted(n for n in set(table) & set(expected) if table[n] != expected[n])[:3]
        raise WeightsError(
            "the model folder does not match the weight server's table "
            f"(missing {missing}, unexpected {extra}, other shapes {wrong}); "
            "start the weight server with weight_layout(ModelConfig.from_json_file(folder))"
        )
