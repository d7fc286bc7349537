"""Every config value's type and range, checked once when a job starts, before anything else happens.

Two sources of types:
- the sections the template itself reads (`seed`, `trainer`, `lr_schedule`, `strategy`, `loader`, the batch keys
  of `data`, `model.optimizer`, ...): the pydantic models below, one per section (of `trainer`, the keys the engine
  reads: lightning.Trainer checks the others itself, trainer.refuse_trainer_arguments);
- the constructors the config builds (each `_target_` under `data`, `model`, `callbacks` and `logger`: the data
  module, the LightningModule, its net and optimizer, callbacks, loggers): their own type hints, plain ones (`int`,
  `float`, `Literal[...]`, `tuple[int, int]`) and, where a hint carries one, a range (`Annotated[int, Field(ge=1)]`),
  checked like the template's keys, with no code here. Arguments without a hint, hints pydantic cannot check (a
  tensor, a module), values Hydra instantiates (a dict with a `_target_`) and values the data fills in (null) pass
  through, to be checked by the constructor.

Values are checked strictly, as YAML and the command line give them: `abc` stays a string and `1.5` is no
integer, so a value that passes reaches the code as it was checked. (Against a constructor's hints a string may
also stand for what strings name, a `Path` or an enum member, and a list for a tuple: YAML has neither.) Each
wrong value is `key=value must be <what is allowed>`, all of them in one UserError. An unknown key in a section
the template reads alone (trainer, monitor, checkpoint, performance, lr_schedule, strategy, loader) is a
misspelling, refused with the closest known key; elsewhere (data, model) keys a section does not declare pass
to the constructor. In those sections every declared key without a default here must be there: the YAML groups are
their one source of defaults, and the code reads no fallback of its own. What depends on several keys (exactly one
batch size, divisibility, warmup in epochs or steps) is checked where it is derived:
plan/resolve.py, plan/batch.py.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pkgutil
import textwrap
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from enum import Enum
from pathlib import PurePath
from typing import Annotated, Any, Literal, Union

from omegaconf import DictConfig
from pydantic import BaseModel, ConfigDict, Field, PydanticUserError, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from scaleup.compat.precision import PRECISIONS
from scaleup.conf import engine_groups
from scaleup.config.plain import lookup, to_plain
from scaleup.errors import UserError, already_in_config, did_you_mean, is_users_code
from scaleup.plan.lr import DECAYS, SCALING_RULES

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
BelowOne = Annotated[float, Field(ge=0, lt=1)]  # momentum, Adam's betas

Accelerator = Literal["auto", "cpu", "gpu", "cuda"]
Devices = Annotated[
    PositiveInt
    | Literal[-1, "-1", "auto"]
    | Annotated[list[NonNegativeInt], Field(min_length=1)]
    | Annotated[str, Field(pattern=r"^\s*\d+\s*(,\s*\d*\s*)+$")],  # "0,1", or "3," for device 3 alone (Lightning's)
    Field(
        description="an integer >= 1 (devices per node), -1 or auto (every visible device), or device ids as a list "
        '([0, 1]) or a string with commas ("0,1")'
    ),
]


# Lightning's own spellings (64-true, bf16-mixed, 16, ...), and the template's auto (resolved by the plan).
Precision = Literal[("auto", *PRECISIONS)]


class Section(BaseModel):
    """A config section's keys and what each may hold (see the module docstring for what passes).

    `closed`: the section belongs to the template, which reads only the keys it knows (`known_keys`): any other
    key there is a misspelling (also one added with `+`), refused with the closest known key.
    """

    model_config = ConfigDict(strict=True, extra="allow", protected_namespaces=())
    closed: typing.ClassVar[bool] = False

    @classmethod
    def known_keys(cls, section: Mapping[str, Any]) -> list[str]:
        """The keys the template reads in `section`."""
        return list(cls.model_fields)

    @classmethod
    def required_keys(cls, section: Mapping[str, Any]) -> list[str]:
        """The known keys of `section` that must be there: those without a default here."""
        return [
            name
            for name in cls.known_keys(section)
            if name in cls.model_fields and cls.model_fields[name].is_required()
        ]

    @classmethod
    def unknown_key(cls, path: str, name: str, section: Mapping[str, Any]) -> str:
        """Why `name` has no place in the closed section at `path` holding `section`, with the closest known key."""
        return f"{dotted(path, name)} is not a key of {path}{did_you_mean(name, cls.known_keys(section), f'{path}.')}"


class ClosedSection(Section):
    closed: typing.ClassVar[bool] = True


class TrainKeys(Section):
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)]  # what Lightning's seed_everything accepts
    dry_run: bool
    ckpt_path: str | None = Field(description="a checkpoint path, last, or null")
    diagnostics_from: str | None = Field(description="a run directory, or null")
    fresh_start: bool = False  # a project's train.yaml from before these keys lacks them
    stop_on_nonfinite_loss: bool = True


class Monitor(ClosedSection):
    metric: str
    mode: Literal["min", "max"]


class Checkpointing(ClosedSection):
    dirpath: str
    every_n_train_steps: PositiveInt | None
    async_save: bool | Literal["auto"] = "auto"


class Performance(ClosedSection):
    tf32: bool
    channels_last: bool


class LRScheduleSettings(ClosedSection):
    base_batch_size: PositiveInt
    base_bn_batch_size: PositiveInt | None
    rule: Literal[SCALING_RULES]
    warmup_epochs: NonNegative | None
    warmup_steps: NonNegativeInt | None
    decay: Literal[DECAYS]
    milestones: list[NonNegative] | None
    gamma: Positive


COMMON_KEYS = ["name", "timeout_minutes", "hang_timeout_minutes"]
DDP_KEYS = ["bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters"]


class Strategy(ClosedSection):
    """Both options' keys: each option's own keys pass only with its name (a DDP run would ignore FSDP's)."""

    name: Literal["ddp", "ddp_spawn", "fsdp"]
    timeout_minutes: Positive
    hang_timeout_minutes: NonNegative | None  # 0 or None: no hang watch (distributed/watchdog.py)
    # ddp
    bucket_cap_mb: Positive
    gradient_as_bucket_view: bool
    static_graph: bool
    find_unused_parameters: bool
    # fsdp (distributed/fsdp.py)
    shard_modules: list[str] | None
    sharding: Literal["full", "hybrid"]
    meta_init: bool
    sync_gradients: Literal["step", "micro_batch"]
    mixed_precision: Literal["bfloat16", "float16"] | None
    cpu_offload: bool
    activation_checkpointing: bool

    @classmethod
    def known_keys(cls, section: Mapping[str, Any]) -> list[str]:
        """The keys every option has (COMMON_KEYS) and those of strategy.name's own option (scaleup/conf/strategy/);
        without a valid name, every key (the name's own message says what is wrong)."""
        fsdp = ["_target_", *(key for key in cls.model_fields if key not in (*COMMON_KEYS, *DDP_KEYS))]
        own = {"ddp": DDP_KEYS, "ddp_spawn": DDP_KEYS, "fsdp": fsdp}.get(section.get("name"), [*DDP_KEYS, *fsdp])
        return [*COMMON_KEYS, *own]

    @classmethod
    def required_keys(cls, section: Mapping[str, Any]) -> list[str]:
        """Without a valid name, only the keys every option has (the name's own message says what is wrong)."""
        if section.get("name") not in typing.get_args(cls.model_fields["name"].annotation):
            return COMMON_KEYS
        return super().required_keys(section)

    @classmethod
    def unknown_key(cls, path: str, name: str, section: Mapping[str, Any]) -> str:
        if name not in cls.model_fields:
            return f"{dotted(path, name)} is not a key of {path}{did_you_mean(name, cls.model_fields, f'{path}.')}"
        key, owner = dotted(path, name), "ddp" if name in DDP_KEYS else "fsdp"
        return (
            f"{key} is a key of strategy={owner}, and this run has strategy.name={section.get('name')}, which would "
            f"ignore it: pass strategy={owner} {key}=VALUE, or leave {key} out"
        )


class Loader(ClosedSection):
    pin_memory: bool | Literal["auto"]
    persistent_workers: bool
    prefetch_factor: PositiveInt | None


class Init(ClosedSection):
    """The weights a run starts from, and what fine-tuning keeps fixed (scaleup/finetune.py, docs/finetuning.md)."""

    weights: str | None = Field(
        description="null (from scratch), a weights file, a checkpoint or run directory, or torchvision:<weights>"
    )
    module: str = Field(description="a submodule of the LightningModule (net, net.backbone), or '' for all of it")
    prefix: str | None = Field(
        description="a key prefix of the file as a string (quote a number: \"init.prefix='13.'\") or null"
    )
    skip: list[str | int] = Field(description="a list of tensor or module names (fc, 13) or regular expressions")
    freeze: list[str | int] = Field(description="a list of parameter or module names (fc, 13) or regular expressions")
    freeze_bn: bool
    bn_batch_size: PositiveInt | None

    @classmethod
    def known_keys(cls, section: Mapping[str, Any]) -> list[str]:
        """Its keys, and the `_target_` that names what does them (the engine's init option's)."""
        return ["_target_", *super().known_keys(section)]

    @classmethod
    def required_keys(cls, section: Mapping[str, Any]) -> list[str]:
        return ["_target_", *super().required_keys(section)]


class DataBatches(Section):
    """The keys every data module takes (scaleup.data.datamodule.GlobalBatchDataModule); the batch keys are the
    template's also beside another LightningDataModule's own (TEMPLATE_BATCH_KEYS)."""

    global_batch_size: PositiveInt | None
    per_device_batch_size: PositiveInt | None
    max_per_device_batch_size: PositiveInt | Literal["auto"] | None
    num_workers: NonNegativeInt


TEMPLATE_BATCH_KEYS = ("global_batch_size", "per_device_batch_size", "max_per_device_batch_size")


class Optimizer(Section):
    """The usual optimizer arguments; the optimizer's own hints add the rest."""

    lr: Positive
    weight_decay: NonNegative
    momentum: BelowOne
    betas: Annotated[
        list[BelowOne], Field(min_length=2, max_length=2, description="two numbers in [0, 1), e.g. [0.9, 0.999]")
    ]
    eps: Positive


class TrainerArgs(ClosedSection):
    """The lightning.Trainer arguments the engine reads before Lightning sees them: the topology and what the plan
    resolves, the run's length, and the progress bar (trainer.py); and a value Lightning takes that would train
    wrong. Every other `trainer.*` key passes to lightning.Trainer as it is, checked by Lightning itself when the
    job starts: the run's own Trainer before its plan is printed, a dry run's probe
    (trainer.refuse_trainer_arguments)."""

    accelerator: Accelerator
    devices: Devices
    num_nodes: PositiveInt | Literal["auto"] = Field(
        description="an integer >= 1, or auto (the nodes torchrun, srun or the PyTorchJob started)"
    )
    precision: Precision
    sync_batchnorm: bool | Literal["auto"] | None
    accumulate_grad_batches: PositiveInt | None
    # The plan's steps: a run of none would train nothing (Lightning takes 0).
    max_epochs: PositiveInt | Literal[-1] | None = Field(
        description="an integer >= 1 (or -1 for no limit, null for Lightning's default); 0 would train nothing"
    )
    max_steps: PositiveInt | Literal[-1] = Field(
        description="an integer >= 1 (or -1 for no limit); 0 would train nothing"
    )
    log_every_n_steps: PositiveInt | Literal["auto"] | None
    limit_train_batches: PositiveInt | Annotated[float, Field(gt=0, le=1)] | None = Field(
        description="null, an integer >= 1 (batches) or a number in (0, 1] (of the epoch); 0 would train nothing"
    )
    overfit_batches: NonNegativeInt | Annotated[float, Field(ge=0, le=1)]  # batches, or a share of them
    fast_dev_run: bool | NonNegativeInt
    enable_progress_bar: bool | None
    # Lightning takes a negative value, and torch's clip_grad_norm_ then turns every gradient around.
    gradient_clip_val: NonNegative | None = Field(
        description="a number >= 0 or null (below 0 the clipping would turn the gradients around)"
    )

    # Lightning takes them, and runs differently than asked: 0 divides by zero at the first epoch's end, `maybe`
    # turns deterministic algorithms on as true would.
    check_val_every_n_epoch: PositiveInt | None = Field(
        description="an integer >= 1 (validate every N epochs) or null (with an integer val_check_interval: every N "
        "batches across epochs)"
    )
    deterministic: bool | Literal["warn"] | None
    min_epochs: NonNegativeInt | None
    min_steps: NonNegativeInt | None

    @classmethod
    def known_keys(cls, section: Mapping[str, Any]) -> list[str]:
        """Every argument of lightning.Trainer (the section passes to it) but those the template sets itself, not only
        those checked here."""
        import lightning as L

        arguments = [name for name in inspect.signature(L.Trainer).parameters if name not in TEMPLATE_SETS]
        return list(dict.fromkeys([*cls.model_fields, *arguments]))

    @classmethod
    def unknown_key(cls, path: str, name: str, section: Mapping[str, Any]) -> str:
        """A Trainer argument the template sets itself: where the setting lives."""
        if name in TEMPLATE_SETS:
            return f"{dotted(path, name)} is set by the template, not in {path}: {TEMPLATE_SETS[name]}"
        return super().unknown_key(path, name, section)


def lightning_defaults() -> dict[str, Any]:
    """Every lightning.Trainer argument but those the template sets itself, with Lightning's own default: the
    trainer group's shared part `trainer/_lightning` (registered by the engine's Hydra plugin), under which
    conf/trainer/default.yaml states only what the template changes. So `trainer.<any argument>=VALUE` works as
    typed, with no default restated."""
    import lightning as L

    parameters = inspect.signature(L.Trainer).parameters.values()
    return {p.name: p.default for p in parameters if p.name not in TEMPLATE_SETS}


# The lightning.Trainer arguments the template sets itself (trainer.py), and where a run chooses what they hold.
TEMPLATE_SETS = {
    "strategy": "choose it with strategy.name=VALUE (ddp, ddp_spawn or fsdp; strategy=fsdp for FSDP's own keys)",
    "callbacks": "yours are the callbacks group's (callbacks=[default,early_stopping], or "
    "+callbacks.<name>={_target_: ...}), the template adds its own",
    "logger": "choose it with the logger group: logger=<option> (tensorboard, csv, mlflow, wandb, many or none)",
    "plugins": "it chooses the checkpoint writer, the cluster environment and the precision plugin (trainer.precision)",
    "default_root_dir": "the run directory is hydra.run.dir=DIR",
    "enable_checkpointing": "every run writes last.ckpt and the best checkpoint (the checkpoint section: "
    "checkpoint.dirpath, checkpoint.every_n_train_steps)",
    "use_distributed_sampler": "its samplers split the data the same way on any device count",
}


class EvalKeys(Section):
    ckpt_path: str
    batch_size: PositiveInt | None
    compile: bool


class EvalTrainer(ClosedSection):
    accelerator: Accelerator
    devices: Devices
    num_nodes: PositiveInt
    precision: Precision | None
    enable_progress_bar: bool


class ExportKeys(Section):
    ckpt_path: str
    output_path: str
    overwrite: bool
    module: str


# Per job: the sections by dotted path ("" is the top level), and the subtrees whose `_target_`s are checked
# against their constructors (eval and export build what the checkpoint's stored config says, checked in training).
SECTIONS: dict[str, dict[str, type[Section]]] = {
    "train": {
        "": TrainKeys,
        "monitor": Monitor,
        "checkpoint": Checkpointing,
        "performance": Performance,
        "data": DataBatches,
        "loader": Loader,
        "model.optimizer": Optimizer,
        "lr_schedule": LRScheduleSettings,
        "init": Init,
        "trainer": TrainerArgs,
        "strategy": Strategy,
    },
    "eval": {"": EvalKeys, "data": DataBatches, "trainer": EvalTrainer},
    "export": {"": ExportKeys},
}
BUILT = {"train": ("data", "model", "callbacks", "logger"), "eval": (), "export": ()}


def validate_config(
    cfg: DictConfig | Mapping[str, Any], job: str = "train", overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Refuse every value of `job`'s config (train, eval, export) whose type or range is wrong: one UserError
    with one `key=value must be ...` per key; and each of the command line's `overrides` that adds with `+` a key
    the config always holds, or a top-level key that nothing reads. Returns the config it checked, resolved into
    plain dicts."""
    config = to_plain(cfg) if isinstance(cfg, DictConfig) else cfg
    problems: dict[str, str] = dict(misplaced_keys(config, job))
    for key, text in added_keys(config, job, overrides):
        problems.setdefault(key, text)
    for path, schema in SECTIONS[job].items():
        for key, text in section_problems(config, path, schema):
            problems.setdefault(key, text)
    for root in BUILT[job]:
        for path, node in targets(config.get(root), root):
            for key, text in constructor_problems(path, node):
                problems.setdefault(key, text)
    if problems:
        raise UserError("; ".join(problems.values()))
    return config


def section_problems(config: Mapping[str, Any], path: str, schema: type[Section]) -> list[tuple[str, str]]:
    """(key, message) for each declared key of the section at `path` whose value does not fit."""
    section = config
    for part in path.split(".") if path else ():
        section = section.get(part) if isinstance(section, Mapping) else None
    if section is None:
        return []
    if not isinstance(section, Mapping):
        return [(path, f"{path}={render(section)} must be a mapping of keys (one per line in its YAML file)")]
    unknown = unknown_keys(section, path, schema)
    if unknown:
        return unknown
    missing = missing_keys(section, path, schema)
    if missing:
        return missing
    try:
        schema.model_validate(section)
    except ValidationError as err:
        names = dict.fromkeys(str(e["loc"][0]) for e in err.errors() if e["loc"] and e["type"] != "missing")
        return [
            (dotted(path, name), message(dotted(path, name), section[name], schema.model_fields[name]))
            for name in names
        ]
    return []


def unknown_keys(section: Mapping[str, Any], path: str, schema: type[Section]) -> list[tuple[str, str]]:
    """(key, message) for each key of a closed section that the template does not know, with the closest known."""
    if not schema.closed:
        return []
    known = schema.known_keys(section)
    return [(dotted(path, name), schema.unknown_key(path, str(name), section)) for name in section if name not in known]


def missing_keys(section: Mapping[str, Any], path: str, schema: type[Section]) -> list[tuple[str, str]]:
    """(key, message) for each key of a closed section that has no default and is not there: a group of the user's
    own that leaves a key out gets no value that no document states."""
    if not schema.closed:
        return []
    return [
        (
            dotted(path, name),
            f"{dotted(path, name)} is missing: the engine's {path} options set it; start a group of your own from "
            f"one of them (`defaults: [<option>, _self_]` at its top) or set it",
        )
        for name in schema.required_keys(section)
        if name not in section
    ]


def unknown_key_message(job: str | None, path: str, name: str, section: Mapping[str, Any]) -> str | None:
    """Why the key `name` is refused in the section at `path` (holding `section`) of `job`'s config, or None where
    that section takes keys of the user's own."""
    schema = SECTIONS.get(job, {}).get(path)
    return schema.unknown_key(path, name, section) if schema is not None and schema.closed else None


def misplaced_keys(config: Mapping[str, Any], job: str) -> list[tuple[str, str]]:
    """(key, message) for each top-level key that `job` reads in one of its sections, not at the top level, where it
    would change nothing: `+max_epochs=3` for `trainer.max_epochs=3`. Other keys of the user's own pass."""
    sections = {path: schema for path, schema in SECTIONS[job].items() if path}
    top = {*SECTIONS[job][""].model_fields, *(path.split(".")[0] for path in sections), *BUILT[job]}
    owners = {name: path for path, schema in reversed(sections.items()) for name in section_keys(config, path, schema)}
    problems = []
    for name, value in config.items():
        if name in owners and name not in top:
            key, given = dotted(owners[name], name), render(value)
            problems.append(
                (name, f"{name}={given} at the top level changes nothing: the key is {key}; pass {key}={given}")
            )
    return problems


def added_keys(config: Mapping[str, Any], job: str, overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(key, message) for each `+key=VALUE` among `overrides` that Hydra took but that adds nothing: a key of a
    section the template reads (and the batch keys of `data`), which the config always holds (Hydra takes `+` over
    a null there only: `+trainer.limit_train_batches` would pass where `+trainer.max_steps` is refused), or a
    top-level key that no part of the job reads (`+warmup_epoch=1`), with the closest setting."""
    sections = SECTIONS[job]
    top = {*sections[""].model_fields, *(path.split(".")[0] for path in sections), *BUILT[job], *engine_groups()}
    problems = []
    for override in overrides:
        if not override.startswith("+") or override.startswith("++"):
            continue
        key = override[1:].partition("=")[0]
        path, _, name = key.rpartition(".")
        if always_there(config, job, path, name):
            problems.append((key, already_in_config(override)))
        elif "." not in key and key in config and key not in top and key not in dict(misplaced_keys(config, job)):
            problems.append(
                (
                    key,
                    f"{override}: nothing reads a top-level {key}{closest_setting(config, key)} (a key of your own "
                    f"belongs in your configs/{job}.yaml)",
                )
            )
    return problems


def always_there(config: Mapping[str, Any], job: str, path: str, name: str) -> bool:
    """Whether `job`'s config always holds the key `name` of the section at `path`: a key the template reads in its
    own sections, at the top level, or a batch key of a training run's `data` (its top config states them)."""
    schema = SECTIONS[job].get(path)
    if schema is None:
        return False
    if path == "":
        return name in schema.model_fields
    if path == "data":
        return job == "train" and name in TEMPLATE_BATCH_KEYS
    section = lookup(config, path)
    return schema.closed and name in schema.known_keys(section if isinstance(section, Mapping) else {})


def closest_setting(config: Mapping[str, Any], name: str) -> str:
    """`; did you mean <dotted key>?` for the key of `config`'s sections (not Hydra's) whose name is closest to
    `name`, or ""."""
    dotted_keys: dict[str, str] = {}
    nodes = [(path, node) for path, node in config.items() if path != "hydra"]
    while nodes:
        path, node = nodes.pop()
        if isinstance(node, Mapping):
            nodes += [(dotted(path, str(key)), value) for key, value in node.items()]
        dotted_keys.setdefault(path.rpartition(".")[2], path)
    hint = did_you_mean(name, [key for key in dotted_keys if key != name])
    return hint and f"; did you mean {dotted_keys[hint.removeprefix('; did you mean ').removesuffix('?')]}?"


def section_keys(config: Mapping[str, Any], path: str, schema: type[Section]) -> set[str]:
    """The keys the section at `path` of `config` takes: those declared here and those the template reads there."""
    section = lookup(config, path)
    return {*schema.model_fields, *schema.known_keys(section if isinstance(section, Mapping) else {})}


def missing_key_message(job: str, name: str) -> str:
    """Why `job` cannot run without the top-level key `name` (`~data` removes the data group), with the form that sets
    it: an option of a group (train.py takes data, model and the engine's sections from groups), a section's keys,
    or a value."""
    if job == "train" and (name in BUILT[job] or name in engine_groups()):
        form = f"choose one of its options: {name}=<option>"
    elif name in SECTIONS[job]:
        form = f"set its keys: {name}.<key>=<value>"
    else:
        form = f"set it: {name}=<value>"
    return f"{name} is missing from the config (~{name} removes it), and {job}.py needs it; {form}"


def targets(tree: Any, path: str) -> typing.Iterator[tuple[str, dict[str, Any]]]:
    """Every node of `tree` with a `_target_` (the node itself included), by dotted path."""
    if not isinstance(tree, dict):
        return
    if "_target_" in tree:
        yield path, tree
    for key, value in tree.items():
        yield from targets(value, dotted(path, key))


def constructor_problems(path: str, node: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for a `_target_` in `node` that does not import, or for each argument that its type hints
    refuse."""
    target, key = str(node["_target_"]), dotted(path, "_target_")
    try:
        pkgutil.resolve_name(target)  # quietly: hydra's get_object would log an ERROR before raising
    except (ImportError, AttributeError) as err:
        return [(key, f"{key}={target} does not import ({err}): check the name, or install what it needs")]
    accepted = accepted_arguments(target)
    if path == "data" and accepted is not None:
        accepted |= set(TEMPLATE_BATCH_KEYS)  # the template's, beside any data module's own
    problems = [
        (
            dotted(path, name),
            f"{dotted(path, name)}: {target.rpartition('.')[2]} takes no argument '{name}' "
            f"({'its arguments: ' + ', '.join(sorted(accepted)) if accepted else 'it takes none'})",
        )
        for name in node
        if accepted is not None and not str(name).startswith("_") and name not in accepted
    ]
    problems = [(key, EXPLAINED.get(key, text)) for key, text in problems]
    for name, (hint, adapter) in argument_hints(target).items():
        value = node.get(name)
        if value is None or (isinstance(value, dict) and "_target_" in value) or fits(adapter, value):
            continue
        problems.append((dotted(path, name), f"{dotted(path, name)}={render(value)} must be {describe(hint)}"))
    return problems


# Arguments no constructor takes for a reason worth its own message
EXPLAINED = {
    "data.shuffle": "remove data.shuffle: the training sampler shuffles every epoch by itself (and a DataLoader "
    "refuses shuffle=True together with a sampler)",
}


@functools.cache
def accepted_arguments(target: str) -> frozenset[str] | None:
    """The keyword arguments the class or function `target` names takes, or None where it takes any it is given.

    A class's `**kwargs` are followed up its bases' `__init__`s where its code passes them on whole
    (`super().__init__(..., **kwargs)`), through the user's code and the engine's; where they go anywhere else (an
    `__init__` that picks from them, another library's), any argument is taken. An unknown argument is then refused
    by name before the call, so that a TypeError raised inside the user's own code is the user's code's
    (errors.py)."""
    try:
        built = pkgutil.resolve_name(target)
    except (ImportError, AttributeError):
        return None
    # object.__init__ takes no argument: a chain of **kwargs that reaches it is closed there
    inits = (
        [vars(c)["__init__"] for c in inspect.getmro(built) if "__init__" in vars(c) and c is not object]
        if isinstance(built, type)
        else [built]
    )
    names: set[str] = set()
    for init in inits:
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names |= {p.name for p in parameters if p.kind in named} - {"self"}
        keywords = [p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
        if not keywords:
            return frozenset(names)
        if not (is_users_or_engines(init) and passes_on_to_base(init, keywords[0])):
            return None
    return frozenset(names) if isinstance(built, type) else None


def passes_on_to_base(init: Any, keywords: str) -> bool:
    """Whether the `__init__` `init` passes its `**keywords` on whole to its base's: `super().__init__(**keywords)`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "__init__"
        and isinstance(call.func.value, ast.Call)
        and getattr(call.func.value.func, "id", None) == "super"
        and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == keywords for k in call.keywords)
        for call in ast.walk(tree)
    )


def is_users_or_engines(function: Any) -> bool:
    """Whether `function` is the user's code or the engine's, not an installed library's."""
    module = getattr(function, "__module__", None) or ""
    try:
        source = inspect.getsourcefile(function) or ""
    except TypeError:  # a builtin
        return False
    return module.split(".")[0] == "scaleup" or is_users_code(source)


@functools.cache
def argument_hints(target: str) -> dict[str, tuple[Any, TypeAdapter]]:
    """The hinted arguments of the class or function `target` names, each with the adapter that checks it.

    Whatever cannot be checked is left out: a target whose hints do not resolve (its own construction says what is
    wrong), and a hint pydantic has no schema for.
    """
    try:
        built = pkgutil.resolve_name(target)
        parameters = inspect.signature(built).parameters
        hints = typing.get_type_hints(built.__init__ if isinstance(built, type) else built, include_extras=True)
    except (ImportError, AttributeError, NameError, TypeError, ValueError):
        return {}
    checked = {}
    for name in parameters:
        if name in hints:
            try:
                checked[name] = (hints[name], TypeAdapter(hints[name]))
            except PydanticUserError:  # e.g. PydanticSchemaGenerationError: no schema for a tensor, a module
                continue
    return checked


def fits(adapter: TypeAdapter, value: Any) -> bool:
    """Whether `value` fits strictly, or as what YAML cannot write: a list for a tuple, a string for a Path or an
    enum member (pydantic's lax mode, without its readings of a string as a number or a boolean)."""
    try:
        adapter.validate_python(value, strict=True)
        return True
    except ValidationError:
        pass
    try:
        return kept(value, adapter.validate_python(value))
    except ValidationError:
        return False


def kept(value: Any, out: Any) -> bool:
    """Whether lax validation only re-wrapped `value`: read no string as a number or a boolean, no number as a
    boolean (or the reverse), no float as an integer."""
    if isinstance(value, list) and isinstance(out, Collection) and not isinstance(out, str | Mapping):
        return not isinstance(out, list | tuple) or (len(out) == len(value) and all(map(kept, value, out)))
    if isinstance(value, Mapping) and isinstance(out, Mapping):
        return all(kept(item, out[key]) for key, item in value.items() if key in out)
    if isinstance(value, bool) or isinstance(out, bool):
        return isinstance(value, bool) and isinstance(out, bool)
    if isinstance(value, str):
        return not isinstance(out, int | float)
    return isinstance(out, type(value)) or (type(value) is int and isinstance(out, float))


def message(key: str, value: Any, field: FieldInfo) -> str:
    allowed = field.description or describe(
        Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    )
    return f"{key}={render(value)} must be {allowed}"


def dotted(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def render(value: Any) -> str:
    """A value as the user types it: null, true, abc, [0, 1]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return f"[{', '.join(render(v) for v in value)}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {render(v)}" for k, v in value.items()) + "}"
    return str(value)


def describe(hint: Any) -> str:
    """What a type hint allows, in words: `Annotated[int, Field(ge=1)] | None` is "an integer >= 1 or null"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        notes = [m for m in args[1:] if isinstance(m, FieldInfo) and m.description]
        return notes[-1].description if notes else describe(args[0]) + bounds(args[1:])
    if origin is Union or origin is types.UnionType:
        return alternatives([part for arg in args for part in parts(arg)])
    if origin is Literal:
        return options(hint)[0] if len(args) == 1 else f"one of {', '.join(options(hint))}"
    if hint is type(None):
        return "null"
    if origin is tuple and args and Ellipsis not in args:  # a fixed length: tuple[int, int, int]
        items = plural(describe(args[0])) if len(set(args)) == 1 else "items"
        return f"a list of {len(args)} {items}"
    if origin in (list, tuple, set, frozenset, Sequence) or hint in (list, tuple, Sequence):
        return "a list" + (f" of {plural(describe(args[0]))}" if args and args[0] is not Ellipsis else "")
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "a mapping"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return f"one of {', '.join(render(member.value) for member in hint)}"  # pydantic reads members by value
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Any: "anything"}
    if hint in names:
        return names[hint]
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "a path"
    name = getattr(hint, "__name__", str(hint))
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def parts(hint: Any) -> list[str]:
    """A union member as alternatives of its own: each value of a Literal, true and false for a bool."""
    if typing.get_origin(hint) is Literal:
        return options(hint)
    return ["true", "false"] if hint is bool else [describe(hint)]


def options(literal: Any) -> list[str]:
    return list(dict.fromkeys(render(value) for value in typing.get_args(literal)))


def alternatives(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def plural(description: str) -> str:
    """ "an integer >= 1" -> "integers >= 1"; a description without an article stays as it is, after "each"."""
    article, _, rest = description.partition(" ")
    if article not in ("a", "an") or not rest:
        return f"items each {description}"
    noun, _, tail = rest.partition(" ")
    return f"{noun}s {tail}".rstrip()


def bounds(metadata: Sequence[Any]) -> str:
    """ " >= 1", " > 0", " in [0, 1)" from the Field / annotated_types constraints of a hint ("" for none)."""
    constraints = [c for m in metadata for c in (m.metadata if isinstance(m, FieldInfo) else [m])]

    def bound(*kinds: str) -> tuple[str, Any] | None:
        return next(((k, getattr(c, k)) for c in constraints for k in kinds if getattr(c, k, None) is not None), None)

    lower, upper = bound("ge", "gt"), bound("le", "lt")
    if lower and upper:
        opening, closing = "[" if lower[0] == "ge" else "(", "]" if upper[0] == "le" else ")"
        return f" in {opening}{lower[1]}, {upper[1]}{closing}"
    if lower or upper:
        kind, limit = lower or upper
        return f" {dict(ge='>=', gt='>', le='<=', lt='<')[kind]} {limit}"
    return ""
