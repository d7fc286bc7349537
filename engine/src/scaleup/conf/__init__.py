"""The engine's Hydra config groups; a project's top configs find them with `hydra.searchpath: [pkg://scaleup.conf]`."""
