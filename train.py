"""`python train.py [key=value ...]`: see configs/train.yaml and the engine's docs/configuration.md."""

from pathlib import Path

from scaleup.entry import main

if __name__ == "__main__":
    main("train", Path(__file__).parent / "configs")
