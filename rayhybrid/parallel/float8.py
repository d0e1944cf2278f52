"""`train.float8`: the transformer blocks' linear layers train in float8, with torchao's recipe
(tensorwise dynamic scaling, torchao.float8), as torchtitan's float8 converter does.

    check_float8(cfg.train.float8, device)            # ConfigError: no torchao, no float8 device
    convert_blocks(stage, cfg.train.float8, tp=...)   # on the meta stage (or after init), before parallelize
    plan["layers.0.attn.wq"] = colwise_style(model, "layers.0.attn.wq")  # a family's TP plan

Modes (`train.float8`): `false` (default: nothing changes), `true` (float8 matmuls on a GPU of CUDA
capability 8.9 or more: H100, H200, L4, L40S; refused elsewhere) and `emulate` (torchao's
emulation: the same casts to float8 and scales, the matmuls in float32 from the float8 values;
any device, slow: for tests and debugging on CPU).

Only the `nn.Linear` layers of the blocks (`layers.*`) are converted, each whose two sizes, once
split over `tp` ranks, are multiples of 16 (what float8 matmuls need); the output head and the
embedding stay as they are. `Float8Linear` keeps the layer's parameters, so names, shapes and
checkpoints do not change. torchao is an optional extra (`pip install 'rayhybrid[float8]'`) and
is imported only here, quietly: its import-time warnings (kernels this build cannot load, a
deprecation in torch's pytree) go to this module's log at debug, not to the terminal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from rayhybrid.config.schema import float8_mode
from rayhybrid.errors import ConfigError

log = logging.getLogger(__name__)

PIP = "pip install 'rayhybrid[float8]'"
MIN_CAPABILITY = (8, 9)
"""float8 tensor cores: Ada (8.9) and Hopper (9.0) and later."""
ALIGN = 16
"""float8 matmuls (torch._scaled_mm) need both sizes of each operand a multiple of 16."""
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


class _ToDebug(logging.Handler):
    """Re-logs what it is given on this module's logger, at debug."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, record.getMessage())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchao's and torch's warnings while torchao imports and converts: to this module's log
    at debug, not to the terminal (their loggers stop propagating meanwhile)."""
    saved = []
    handler = _ToDebug()
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate


def _torchao_float8():
    """torchao.float8, imported quietly; a one-line ConfigError without torchao."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("train.float8", f"needs torchao, which is not installed: {PIP}")
    with _quiet():
        try:
            from torchao import float8
            from torchao.float8 import float8_tensor_parallel  # noqa: F401 - the TP styles, imported quietly
        except ImportError as err:
            raise ConfigError("train.float8", f"torchao does not import ({err}); {PIP} (torchao>=0.18)") from None
    return float8


def check_float8(value: object, device: torch.device) -> None:
    """`train.float8` can run on `device`: torchao imports, and `true` has float8 matmuls there
    (a CUDA device of capability 8.9 or more). Else one ConfigError line naming the fix."""
    mode = float8_mode(value)
    if mode == "false":
        return
    _torchao_float8()
    if mode == "true" and not has_float8(device):
        what = f"device {device.type}"
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            what = f"{torch.cuda.get_device_name(device)} (CUDA capability {major}.{minor})"
        raise ConfigError(
            "train.float8",
            f"{what} has no float8 matmuls (they need CUDA capability 8.9 or more: H100, H200, L4); "
            "set train.float8=false, or train.float8=emulate to check float8's numerics slowly",
        )


def has_float8(device: torch.device) -> bool:
    """Whether `device` multiplies in float8: a CUDA device of capability 8.9 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def convert_blocks(stage: nn.Module, value: object, *, tp: int) -> nn.Module:
    """Swap the blocks' linear layers of `stage` for torchao's `Float8Linear` (mode `true` or
    `emulate`; `false`: `stage` as it is), on the meta device or materialised. Before the model's
    parallelize: TP and FSDP2 then shard the converted layers (`colwise_style`, `rowwise_style`)."""
    mode = float8_mode(value)
    if mode == "false":
        return stage
    float8 = _torchao_float8()
    # pad_inner_dim: the weight gradient's matmul runs over the tokens (micro-batch x seq_len),
    # which the GPU's float8 matmul needs in multiples of 16; padded, any batch shape trains.
    config = float8.Float8LinearConfig(emulate=mode == "emulate", pad_inner_dim=mode == "true")

    def in_blocks(linear: nn.Linear, fqn: str) -> bool:
        return fqn.startswith("layers.") and all(
            size % tp == 0 and (size // tp) % ALIGN == 0 for size in (linear.in_features, linear.out_features)
        )

    with _quiet():
        float8.convert_to_float8_training(stage, module_filter_fn=in_blocks, config=config)
    converted = [name for name, m in stage.named_modules() if is_float8(m)]
    log.debug("train.float8=%s: %d linear layers in float8: %s", mode, len(converted), converted)
    return stage


def is_float8(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (False whenever torchao was never imported)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def colwise_style(model: nn.Module, fqn: str) -> ColwiseParallel:
    """Column-wise TP for linear `fqn`: torchao's float8 style (the input cast to float8 before
    it is distributed) for a float8 layer, torch's own for any other."""
    if is_float8(model.get_submodule(fqn)):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

        return Float8ColwiseParallel()
    return ColwiseParallel()


def rowwise_style(model: nn.Module, fqn: str) -> RowwiseParallel:
    """Row-wise TP for linear `fqn`, float8 as `colwise_style`."""
    if is_float8(model.get_submodule(fqn)):
        from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

        return Float8RowwiseParallel()
    return RowwiseParallel()


def replicated_input_style(model: nn.Module, fqn: str) -> PrepareModuleInput:
    """The input of sub-layer `fqn` as one replicated DTensor its linears share (their input
    gradients add up locally: one all-reduce in backward), cast to float8 once when every
    linear in it is float8 (q, k and v share one cast)."""
    layouts = {"input_layouts": (Replicate(),), "desired_input_layouts": (Replicate(),)}
    linears = [m for m in model.get_submodule(fqn).modules() if isinstance(m, nn.Linear)]
    if linears and all(is_float8(m) for m in linears):
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

        return PrepareFloat8ModuleInput(**layouts)
    return PrepareModuleInput(**layouts)
