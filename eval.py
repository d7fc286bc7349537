"""`python eval.py [key=value ...]`: see configs/eval.yaml and docs/configuration.md."""

import hydra

from scaleup.distributed.run_dir import register_resolvers
from scaleup.errors import exit_on_user_error
from scaleup.evaluate import evaluate

register_resolvers()


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
@exit_on_user_error
def main(cfg):
    return evaluate(cfg)


if __name__ == "__main__":
    main()
