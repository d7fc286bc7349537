"""`python export.py [key=value ...]`: see configs/export.yaml and the engine's docs/configuration.md."""

from pathlib import Path

from scaleup.entry import main

if __name__ == "__main__":
    main("export", Path(__file__).parent / "configs")
