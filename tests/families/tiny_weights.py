"""The rule that makes a tiny reference checkpoint sensitive to its inputs: default
initialisation lets the prompt move the output by about 0.1 %, too little for a parity test to
notice a broken path, so linear weights are re-drawn ~ N(0, (gain / sqrt(fan_in))^2) and
parameters that start constant (ones or zeros) get a little noise."""

from __future__ import annotations

from collections.abc import Callable


def redraw(
    model,
    generator,
    linear_gain: float,
    constant_noise: float,
    is_linear: Callable[[str, object], bool] = lambda name, param: param.ndim == 2,
) -> None:
    """Re-draw `model`'s parameters in place, in `named_parameters` order, from `generator`."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_linear(name, param):
                std = linear_gain / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:
                param.add_(torch.randn(param.shape, generator=generator) * constant_noise)


def save_drawn(model_class, config: dict, directory, seed: int, linear_gain, constant_noise):
    """`model_class(**config)` made under torch's seed `seed`, re-drawn (`redraw`, from a
    generator of the same seed) and saved into `directory`; returns it in eval mode."""
    import torch

    torch.manual_seed(seed)
    model = model_class(**config)
    redraw(model, torch.Generator().manual_seed(seed), linear_gain, constant_noise)
    model.save_pretrained(str(directory))
    return model.eval()
