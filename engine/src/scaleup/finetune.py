"""A run that starts from weights (the `init` section): which tensors of a file go into which of the model's, what
is left as built (a new head), what is frozen; then the weights loaded into the model as the run built it.

The model is built once, as for a run from scratch (the same random numbers, so a new head starts as it would),
then the file's tensors are copied over it: into the model itself where it was built eagerly, or, for strategy=fsdp
built on the meta device, into each rank's shards when the strategy makes them, one tensor at a time
(`MetaInit.loaded`, read by `fsdp.eager_values`). Nothing else of the file is read: the optimizer, the step and the
data order start afresh. A resumed run loads nothing: its checkpoint holds the trained weights.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from scaleup.checkpoints.weights_file import MissingWeights, WeightsFile, open_weights
from scaleup.errors import UserError
from scaleup.modules import selected, submodule, unmatched
from scaleup.observability.rows import log_rows, shown
from scaleup.plan.checks import BATCH_NORMS
from scaleup.plan.resolve import Plan

if TYPE_CHECKING:
    from scaleup.config.schema import Init
    from scaleup.distributed.meta_init import MetaInit

# init.weights in a dry run on a machine without the file (a laptop planning a cluster's run).
NOT_HERE = "not on this machine: a dry run plans without it, the run reads it where it runs"


@dataclass(frozen=True)
class Matched:
    """How a file's tensors map onto the module's state_dict (names relative to `init.module`)."""

    prefix: str  # the file's key prefix taken (`model.`, `net.`, `module.`, ...; "" for none)
    loaded: dict[str, str]  # the module's name -> the file's name
    total: int  # tensors in the module's state_dict
    left_new: list[str] = field(default_factory=list)  # as built: named by init.skip, or num_batches_tracked
    mismatched: dict[str, str] = field(default_factory=dict)  # name -> "file [..], model [..]" (left new too)
    unused: list[str] = field(default_factory=list)  # the file's names that fit nothing in the module


@dataclass(frozen=True)
class InitialWeights:
    """The `init` section's facts in the plan (plan.json's `init`; its row says them in words): the weights file as
    given and its kind, the module they go into ("" for the LightningModule), its tensors, how many were loaded from
    the file (None: a resume loads none) and left as built; the parameters init.freeze froze; init.freeze_bn."""

    key: ClassVar[str] = "init"
    weights: str = ""
    weights_kind: str = ""
    module: str = ""
    tensors: int | None = None
    loaded: int | None = None
    left_as_built: int | None = None
    frozen: int = 0
    freeze_bn: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self, plan: Plan) -> list[tuple[str, str]]:
        """The plan's `initial weights` row: where the weights came from and how many of the module's tensors they
        set, or that a resume loads none; what is frozen."""
        parts = []
        if self.weights and self.loaded is None:  # a resume, or a dry run without the file (its kind says)
            why = self.weights_kind or "not loaded, the run resumes from its checkpoint (its trained weights)"
            parts.append(f"{self.weights}: {why}")
        elif self.weights:
            parts.append(
                f"{self.weights} ({self.weights_kind}) into {self.module or 'the LightningModule'}: "
                f"{self.loaded} of {self.tensors} tensors loaded, {self.left_as_built} left as built"
            )
        if self.frozen:
            parts.append(f"{self.frozen} parameters frozen (init.freeze)")
        if self.freeze_bn:
            where = f" in {self.module}" if plan.batchnorm_unfrozen else ""
            parts.append(f"BatchNorm{where} in eval mode: running statistics fixed (init.freeze_bn)")
        return [("initial weights", "; ".join(parts))]


@dataclass(frozen=True)
class Start:
    """What the `init` section does to this run's model: its freezing right after the build (`prepare_start`), its
    weights once the run knows whether it resumes (`begin`)."""

    settings: Init
    frozen: list[str] = field(default_factory=list)
    has_batchnorm: bool = False  # BatchNorm layers in init.module
    every_batchnorm_frozen: bool = False  # init.freeze_bn, and no BatchNorm layer outside init.module
    # init.freeze_bn with BatchNorm layers outside init.module: those, which still compute batch statistics
    batchnorm_unfrozen: tuple[str, ...] = ()
    file: WeightsFile | None = None
    matched: Matched | None = None

    @property
    def label(self) -> str:
        return self.settings.module or "the LightningModule"

    def begin(
        self, plan: Plan, model: nn.Module, recording: MetaInit | None, *, resumed: Path | str | None, dry_run: bool
    ) -> Plan:
        """Open init.weights and match its tensors to the module (a tensor left as built that init.skip does not name,
        or that init.freeze freezes, is refused in one line), load them (not in a dry run), show what was loaded and
        what not (rank 0), and return the plan with its record (InitialWeights) and BatchNorm's part: the batch the
        weights were trained with, the layers init.freeze_bn keeps in eval mode. A resumed run opens no file; a dry run
        plans without one that is not on this machine."""
        if self.settings.weights is None and not self.frozen and not self.settings.freeze_bn:
            return plan
        start = self
        if self.settings.weights is not None and resumed is None:
            start = self.opened(model, dry_run)
            if not dry_run:
                load(model, self.settings.module, start.matched, start.file, recording)
        if rank_zero_only.rank == 0:
            start.report(resumed)
        trained_with = self.settings.bn_batch_size or (start.file.bn_batch_size if start.file else None)
        compare = self.has_batchnorm and not self.settings.freeze_bn
        return replace(
            plan,
            records=(*plan.records, start.record(resumed)),
            trained_bn_batch_size=trained_with if compare else None,
            batchnorm_frozen=self.every_batchnorm_frozen,
            batchnorm_frozen_module=(self.settings.module or "") if self.settings.freeze_bn else "",
            batchnorm_unfrozen=self.batchnorm_unfrozen,
        )

    def opened(self, model: nn.Module, dry_run: bool) -> Start:
        """This start with init.weights open and matched to the module (one line where a tensor it leaves as built is
        frozen). A dry run plans without a file that is not on this machine: the run reads it where it runs."""
        try:
            file = open_weights(self.settings.weights)
        except MissingWeights:
            if dry_run:
                return self
            raise
        matched = match(file, model.get_submodule(self.settings.module), self.settings)
        if random := [name for name in self.frozen if name in matched.left_new or name in matched.mismatched]:
            raise UserError(
                f"init.freeze={listed(self.settings.freeze)} freezes {shown(random)} of {self.label}, which "
                "init.weights does not fill (init.skip leaves them as built): they would keep their random values; "
                "leave them out of init.freeze"
            )
        return replace(self, file=file, matched=matched)

    def record(self, resumed: Path | str | None) -> InitialWeights:
        """The plan's record of this start: the file and its kind, the module, its tensors loaded from the file and
        left as built (none loaded when the run resumes), the frozen parameters, init.freeze_bn."""
        record = InitialWeights(
            weights=str(self.settings.weights or ""),
            module=self.settings.module or "",
            frozen=len(self.frozen),
            freeze_bn=bool(self.settings.freeze_bn),
        )
        if self.settings.weights is not None and self.file is None and resumed is None:
            record = replace(record, weights_kind=NOT_HERE)
        if self.file is not None and self.matched is not None and resumed is None:
            record = replace(
                record,
                weights=str(self.file.given),
                weights_kind=self.file.kind,
                tensors=self.matched.total,
                loaded=len(self.matched.loaded),
                left_as_built=len(self.matched.left_new) + len(self.matched.mismatched),
            )
        return record

    def report(self, resumed: Path | str | None) -> None:
        """One block before training: what was taken from the file, what stays as built and why, what of the file
        was not used, what is frozen."""
        rows = [("not loaded", f"the run resumes from {resumed} (its trained weights)")] if resumed else []
        if self.settings.weights is not None and self.file is None and not resumed:
            rows.append(("not checked", NOT_HERE))
        if self.file is not None and self.matched is not None:
            matched = self.matched
            taken = f"its keys under {matched.prefix!r}" if matched.prefix else "its keys as they are"
            rows.append(("loaded", f"{len(matched.loaded)} of {matched.total} tensors of {self.label} ({taken})"))
            if matched.left_new:
                rows.append(("left as built", shown(matched.left_new)))
            if matched.mismatched:
                rows.append(("other shape", shown([f"{k} ({v})" for k, v in matched.mismatched.items()])))
            if matched.unused:
                rows.append(("not used", shown(matched.unused)))
        if self.frozen:
            rows.append(("frozen", shown(self.frozen)))
        if self.settings.freeze_bn:
            where = f" in {self.label}" if self.batchnorm_unfrozen else ""
            rows.append(("BatchNorm", f"eval mode in training{where}: the weights' running statistics, never updated"))
            if self.batchnorm_unfrozen:
                rows.append(("batch statistics", f"{shown(self.batchnorm_unfrozen)}: BatchNorm outside {self.label}"))
        title = f"initial weights: {self.file.given} ({self.file.kind})" if self.file else "fine-tuning"
        if self.settings.weights is not None and self.file is None:
            title = f"initial weights: {self.settings.weights}"
        log_rows(title, rows)


def prepare_start(settings: Init, model: nn.Module) -> Start:
    """Right after the build, before the plan counts what trains: freeze init.freeze, keep BatchNorm in eval mode for
    init.freeze_bn (and check that init.module is there)."""
    if settings.weights is None and not settings.freeze and not settings.freeze_bn:
        return Start(settings)
    target = submodule(model, settings.module, key="init.module")
    frozen = freeze(target, settings.freeze)
    if frozen and not any(parameter.requires_grad for parameter in model.parameters()):
        raise UserError(everything_frozen(settings.freeze, target, frozen))
    if settings.freeze_bn:
        keep_batchnorm_in_eval(target, whole=not settings.module)
    inside = {id(module) for module in target.modules()}
    norms = [module for module in target.modules() if isinstance(module, BATCH_NORMS)]
    outside = tuple(
        name for name, module in model.named_modules() if isinstance(module, BATCH_NORMS) and id(module) not in inside
    )
    frozen_bn = bool(settings.freeze_bn)
    return Start(settings, frozen, bool(norms), frozen_bn and not outside, outside if frozen_bn else ())


def everything_frozen(patterns: list[str | int], target: nn.Module, frozen: list[str]) -> str:
    """One line: init.freeze leaves nothing of the model to train (torch would fail at the first backward pass)."""
    count = sum(target.get_parameter(name).numel() for name in frozen)
    owners = list(dict.fromkeys(name.rpartition(".")[0] or name for name in frozen))
    example = f", e.g. all but the last module: init.freeze={listed(owners[:-1])}" if len(owners) > 1 else ""
    return (
        f"init.freeze={listed(patterns)} freezes every parameter of the model ({count:,} in {len(frozen)} tensors): "
        f"nothing would train; name only what stays fixed{example}"
    )


def listed(patterns: Iterable[str | int]) -> str:
    """A list of names as typed on the command line: [0,1,fc]."""
    return f"[{','.join(map(str, patterns))}]"


def match(file: WeightsFile, target: nn.Module, settings: Init) -> Matched:
    """The file's tensors that go into `target`, by name and shape; a tensor of `target` that none fills, unless
    init.skip names it, is refused in one line."""
    wanted = {name: tuple(t.shape) for name, t in target.state_dict().items()}
    if wrong := unmatched(settings.skip, list(wanted)):
        raise UserError(
            f"init.skip={wrong[0]} names no tensor of {settings.module or 'the LightningModule'} "
            f"(e.g. {shown(list(wanted), 4)})"
        )
    prefix = settings.prefix if settings.prefix is not None else best_prefix(file, wanted, settings.module)
    loaded, mismatched, unused = {}, {}, []
    for key, (shape, _) in file.shapes.items():
        name = key[len(prefix) :] if key.startswith(prefix) else None
        if name not in wanted:
            unused.append(key)
        elif tuple(shape) != wanted[name]:
            mismatched[name] = f"file {list(shape)}, model {list(wanted[name])}"
        elif not selected(settings.skip, name):
            loaded[name] = key
    left = [name for name in wanted if name not in loaded and name not in mismatched]
    # A file from before BatchNorm counted its batches has no num_batches_tracked: torch's own loading allows it.
    refused = [
        name
        for name in wanted
        if name not in loaded
        and not selected(settings.skip, name)
        and (name in mismatched or not name.endswith("num_batches_tracked"))
    ]
    if refused:
        raise UserError(not_filled(file, settings, refused, mismatched))
    return Matched(prefix, loaded, len(wanted), left, mismatched, unused)


def not_filled(file: WeightsFile, settings: Init, refused: list[str], mismatched: Mapping[str, str]) -> str:
    """One line: the first tensor the file does not fill and why, how many more, and the keys that fix it."""
    first, rest = refused[0], refused[1:]
    why = f"has another shape in the file ({mismatched[first]})" if first in mismatched else "is not in the file"
    more = f" (and {len(rest)} more: {', '.join(rest[:4])}{', ...' if len(rest) > 4 else ''})" if rest else ""
    owners = list(dict.fromkeys(name.rpartition(".")[0] or name for name in refused))
    return (
        f"init.weights={file.given}: {first} of {settings.module or 'the LightningModule'} {why}{more}, so it would "
        f"stay as built; name what may stay new in init.skip (e.g. init.skip=[{','.join(owners[:3])}]), or load "
        "into another module (init.module) or from another key prefix of the file (init.prefix)"
    )


def best_prefix(file: WeightsFile, wanted: Mapping[str, tuple[int, ...]], module: str) -> str:
    """The prefix of the file's keys under which most of them are tensors of the module by name and shape (`model.`,
    `net.`, `module.`, `_orig_mod.`, ... or none). Between prefixes that fit as many, the one ending in the module's
    own name wins; where that does not decide, init.prefix must. Names that fit with no shape that does are another
    architecture's weights, refused in one line."""
    label = module or "the LightningModule"
    by_name, by_shape, example = prefix_counts(file, wanted)
    if not by_name:
        raise UserError(
            f"init.weights={file.given}: none of its {len(file.shapes)} tensors ({shown(list(file.shapes), 3)}) is "
            f"a tensor of {label} ({shown(list(wanted), 3)}): name the module they are for with init.module, or the "
            "file's key prefix with init.prefix"
        )
    if not by_shape:
        key, name = example
        raise UserError(
            f"init.weights={file.given}: another architecture: no tensor of it fits {label} by name and shape (e.g. "
            f"{key} is {list(file.shapes[key][0])}, {name} of {label} {list(wanted[name])}); build the network it is "
            "for (model.net), or load it into the submodule it fits (init.module)"
        )
    most = max(by_shape.values())
    best = [prefix for prefix, count in by_shape.items() if count == most]
    if len(best) > 1 and module:
        best = [prefix for prefix in best if prefix.endswith(f"{module}.")] or best
    if len(best) > 1:
        raise UserError(
            f"init.weights={file.given}: its tensors fit {label} under several key prefixes "
            f"({', '.join(repr(p) for p in sorted(best))}): choose one with init.prefix=<prefix>"
        )
    return best[0]


def prefix_counts(
    file: WeightsFile, wanted: Mapping[str, tuple[int, ...]]
) -> tuple[Counter[str], Counter[str], tuple[str, str]]:
    """For each prefix of the file's keys, how many of its keys are then names of the module, and how many also have
    the module's shape (BatchNorm's step counter, a scalar under every BatchNorm's name, tells no architecture apart:
    not counted); and an example for a message, a (key, name) that fits by name: the first of another shape."""
    by_name: Counter[str] = Counter()
    by_shape: Counter[str] = Counter()
    fits, other_shape = [], []
    for key, (shape, _) in file.shapes.items():
        parts = key.split(".")
        for i in range(len(parts)):
            name = ".".join(parts[i:])
            if name not in wanted:
                continue
            prefix = "".join(f"{part}." for part in parts[:i])
            by_name[prefix] += 1
            fits.append((key, name))
            if tuple(shape) != wanted[name]:
                other_shape.append((key, name))
            elif not name.endswith("num_batches_tracked"):
                by_shape[prefix] += 1
    return by_name, by_shape, (other_shape or fits or [("", "")])[0]


def freeze(target: nn.Module, patterns: list[str | int]) -> list[str]:
    """Parameters that init.freeze names stop training: requires_grad=False, so the engine's optimizer leaves them
    out and DDP reduces no gradient for them (none is computed: no "unused parameters" error either)."""
    names = [name for name, _ in target.named_parameters()]
    if wrong := unmatched(patterns, names):
        raise UserError(f"init.freeze={wrong[0]} names no parameter (e.g. {shown(names, 4)})")
    frozen = [name for name in names if selected(patterns, name)]
    for name in frozen:
        target.get_parameter(name).requires_grad_(False)
    return frozen


def keep_batchnorm_in_eval(module: nn.Module, whole: bool) -> None:
    """Every BatchNorm layer under `module` runs in eval mode, also in training: it normalises with the running
    statistics of the weights and never updates them. Set before each forward pass of `module` (of each of its
    children for the `whole` LightningModule, whose own forward may never run), since Lightning puts the model in
    training mode at each epoch; the layers are looked up then, so SyncBatchNorm layers put in their place count
    too."""

    def to_eval(owner: nn.Module, args: tuple) -> None:
        for layer in owner.modules():
            if isinstance(layer, BATCH_NORMS):
                layer.eval()

    for owner in list(module.children()) if whole else [module]:
        owner.register_forward_pre_hook(to_eval)


def load(model: nn.Module, module: str, matched: Matched, file: WeightsFile, recording: MetaInit | None) -> None:
    """Copy the file's tensors into the model: now where the tensor is real; where it is on the meta device
    (strategy=fsdp's sharded build), when the strategy fills each rank's shards from the recording."""
    target = model.get_submodule(module)
    state = target.state_dict(keep_vars=True)
    where = f"{module}." if module else ""
    with torch.no_grad():
        for name, key in matched.loaded.items():
            tensor = state[name]
            if tensor.is_meta:
                if recording is not None:
                    recording.loaded[f"{where}{name}"] = functools.partial(file.read, key)
            else:
                tensor.copy_(file.read(key))
