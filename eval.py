"""`python eval.py [key=value ...]`: see configs/eval.yaml and docs/configuration.md."""

from pathlib import Path

import hydra

from scaleup.distributed.run_dir import register_resolvers
from scaleup.errors import exit_on_user_error, one_line_composition_errors
from scaleup.evaluate import evaluate

register_resolvers()


@one_line_composition_errors(Path(__file__).resolve().parent / "configs", "eval")
@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
@exit_on_user_error
def main(cfg):
    return evaluate(cfg)


if __name__ == "__main__":
    main()
