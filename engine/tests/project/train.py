"""`python train.py [key=value ...]` in the engine suite's project."""

from pathlib import Path

from scaleup.entry import main

if __name__ == "__main__":
    main("train", Path(__file__).parent / "configs")
