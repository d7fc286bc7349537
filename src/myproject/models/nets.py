"""Plain `nn.Module` networks: no Lightning inside, so exported weights load anywhere."""

from collections.abc import Callable
from typing import Literal, get_args

import torchvision
from torch import nn

# The hints say what each argument may be; the training job checks the config against them before it starts.
Norm = Literal["batch", "group", "none"]
NORMS = get_args(Norm)


def norm_layer(kind: Norm) -> Callable[[int], nn.Module]:
    """BatchNorm (batch statistics: per device unless synced), GroupNorm (per sample: any batch, any device
    count) or nothing."""
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "group":
        return lambda channels: nn.GroupNorm(min(32, channels // 4), channels)
    if kind == "none":
        return lambda channels: nn.Identity()
    raise ValueError(f"norm={kind!r} is not one of {', '.join(NORMS)}")


class DigitsCNN(nn.Sequential):
    """A small CNN for 8x8 digits: three 3x3 conv blocks, global pooling, a linear head."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        width: int = 32,
        norm: Norm = "batch",
        dropout: float = 0.0,
    ) -> None:
        if not 0 <= dropout < 1:  # torch takes 1, which zeroes every feature
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        make_norm = norm_layer(norm)

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [
                nn.Conv2d(cin, cout, 3, padding=1, bias=norm == "none"),
                make_norm(cout),
                nn.ReLU(inplace=True),
            ]

        super().__init__(
            *block(in_channels, width),
            *block(width, 2 * width),
            nn.MaxPool2d(2),
            *block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(4 * width, num_classes),
        )


def resnet(
    name: str, num_classes: int, in_channels: int = 3, norm: Norm = "batch", small_input: bool = False
) -> nn.Module:
    """torchvision's ResNet by name (`resnet18`, `resnet50`, ...), randomly initialised.

    `small_input=True` swaps the 7x7/2 stem and max-pool for a 3x3/1 conv, the usual change for 32x32 images.
    `in_channels` other than 3 (grey images) gets a stem of that width.
    """
    net = getattr(torchvision.models, name)(weights=None, num_classes=num_classes, norm_layer=norm_layer(norm))
    if small_input:
        net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return net
