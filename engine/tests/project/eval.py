"""`python eval.py [key=value ...]` in the engine suite's project."""

from pathlib import Path

from scaleup.entry import main

if __name__ == "__main__":
    main("eval", Path(__file__).parent / "configs")
