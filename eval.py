"""`python eval.py [key=value ...]`: see configs/eval.yaml and the engine's docs/configuration.md."""

from pathlib import Path

from scaleup.entry import main

if __name__ == "__main__":
    main("eval", Path(__file__).parent / "configs")
